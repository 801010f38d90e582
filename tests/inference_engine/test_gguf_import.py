"""GGUF files served through the model cache: a tiny Llama and Qwen3 written as llama.cpp writes them (Llama's rotary
rows permuted, F32/F16/Q8_0/Q4_0 matrices, a byte-level BPE tokenizer and chat template in the metadata) convert to
the weights they store and decode as the checkpoint they came from; bad files stop `serve` with status 2 and a reason;
a damaged cache is rebuilt and an intact one reused."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoTokenizer, PreTrainedModel

from inference_engine.model_source import MANIFEST, resolve_model
from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from tests.support.daemon import CONSOLE_SCRIPT
from tests.support.gguf_files import CHAT_TEMPLATE, TENSOR_TYPES, save_stored_checkpoint, write_gguf
from tests.support.tokenizers import EOS_TOKEN_ID, save_test_tokenizer

ARCHS = ("llama", "qwen3")
PROMPT = [5, 17, 33, 2, 90, 45, 7, 61]
STEPS = 16
# The conversion adds no error of its own: against the weights the file stores, logits agree to float32 noise.
EXACT_ATOL = 1e-5
# Worst logit error against the unrounded checkpoint, relative to the largest logit. F16 rounds each weight by at most
# 2^-11 (measured: 3.4e-4 llama, 8.7e-4 qwen3); bfloat16's 2^-8 would exceed the bound. Q8_0 rounds by up to 1/254 of
# each 32-weight block's largest (measured: 1.1e-2, 2.6e-2); a wrong scale or block layout would be far outside it.
RELATIVE_LOGIT_TOLERANCE = {"F16": 4 * 2.0**-11, "Q8_0": 0.05}
# Of the checkpoint's 16 greedy choices (teacher-forced), how many a rounded file must keep (measured: 15 or 16).
KEPT_CHOICES = {"F16": 15, "Q8_0": 14}

GGUFFactory = Callable[..., Path]
# A greedy decode: the tokens after PROMPT, and the logits of one forward over PROMPT + tokens ([len, V]).
Decode = tuple[list[int], torch.Tensor]

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def gguf_file(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> GGUFFactory:
    """`gguf_file(arch, tensor_type)`: the tiny checkpoint of `arch` written as a GGUF file (once per module)."""
    root = tmp_path_factory.mktemp("gguf")
    written: dict[tuple[str, str], Path] = {}

    def factory(arch: str, tensor_type: str = "F32") -> Path:
        if (arch, tensor_type) not in written:
            written[arch, tensor_type] = write_gguf(checkpoints[arch], root / f"{arch}-{tensor_type}.gguf", tensor_type)
        return written[arch, tensor_type]

    return factory


@pytest.fixture(scope="module")
def reference(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Decode]:
    """`reference(arch, tensor_type)`: the greedy decode of the checkpoint of `arch` loaded from safetensors, its
    weights rounded as a file of `tensor_type` stores them (F32: the checkpoint itself)."""
    root = tmp_path_factory.mktemp("stored")
    decoded: dict[tuple[str, str], Decode] = {}

    def factory(arch: str, tensor_type: str) -> Decode:
        if (arch, tensor_type) not in decoded:
            directory = (
                checkpoints[arch]
                if tensor_type == "F32"
                else save_stored_checkpoint(checkpoints[arch], tensor_type, root / f"{arch}-{tensor_type}")
            )
            decoded[arch, tensor_type] = _decode(_load(directory))
        return decoded[arch, tensor_type]

    return factory


def _load(directory: Path) -> PreTrainedModel:
    """The model of `directory` as the daemon's torch backend loads it (fp32, cpu)."""
    return TorchVerifier.load(directory, device="cpu", dtype="float32").model


@torch.inference_mode()
def _decode(model: PreTrainedModel) -> Decode:
    ids = list(PROMPT)
    for _ in range(STEPS):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT) :], _forced_logits(model, ids)


@torch.inference_mode()
def _forced_logits(model: PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    """The logits after each of `tokens`, from one forward ([len(tokens), V])."""
    return model(torch.tensor([tokens])).logits[0]


def _choices(logits: torch.Tensor) -> list[int]:
    """The greedy pick after each history of PROMPT + a continuation, from the logits over both. When these equal the
    continuation itself, the model decodes it greedily (each step sees the same history)."""
    return [int(t) for t in logits[len(PROMPT) - 1 : -1].argmax(-1)]


@pytest.mark.parametrize("tensor_type", TENSOR_TYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_a_gguf_file_converts_to_exactly_the_weights_it_stores(
    arch: str, tensor_type: str, gguf_file: GGUFFactory, reference: Callable[[str, str], Decode], tmp_path: Path
) -> None:
    resolved = resolve_model(str(gguf_file(arch, tensor_type)), tmp_path / "cache")
    assert resolved.converted and not resolved.cached
    tokens, expected = reference(arch, tensor_type)
    logits = _forced_logits(_load(resolved.directory), PROMPT + tokens)
    assert _choices(logits) == tokens
    torch.testing.assert_close(logits, expected, rtol=0.0, atol=EXACT_ATOL)


@pytest.mark.parametrize("tensor_type", ["F16", "Q8_0"])
@pytest.mark.parametrize("arch", ARCHS)
def test_f16_and_q8_0_files_decode_as_the_checkpoint_within_their_rounding(
    arch: str, tensor_type: str, gguf_file: GGUFFactory, reference: Callable[[str, str], Decode], tmp_path: Path
) -> None:
    tokens, expected = reference(arch, "F32")
    converted = _load(resolve_model(str(gguf_file(arch, tensor_type)), tmp_path / "cache").directory)
    logits = _forced_logits(converted, PROMPT + tokens)
    relative_error = float((logits - expected).abs().max() / expected.abs().max())
    assert relative_error <= RELATIVE_LOGIT_TOLERANCE[tensor_type]
    kept = sum(choice == token for choice, token in zip(_choices(logits), tokens, strict=True))
    assert kept >= KEPT_CHOICES[tensor_type], f"{kept} of {STEPS} greedy choices kept"


@pytest.mark.parametrize("arch", ARCHS)
def test_the_model_directory_carries_the_files_config_tokenizer_chat_template_and_end_token(
    arch: str, gguf_file: GGUFFactory, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    directory = resolve_model(str(gguf_file(arch)), tmp_path / "cache").directory
    config, source = AutoConfig.from_pretrained(directory), AutoConfig.from_pretrained(checkpoints[arch])
    assert config.model_type == arch
    for name in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "tie_word_embeddings",
    ):
        assert getattr(config, name) == getattr(source, name), name
    assert config.rope_parameters["rope_theta"] == source.rope_parameters["rope_theta"]
    assert config.rms_norm_eps == pytest.approx(source.rms_norm_eps, rel=1e-6)  # GGUF stores it as float32

    tokenizer = AutoTokenizer.from_pretrained(directory)
    expected = AutoTokenizer.from_pretrained(save_test_tokenizer(tmp_path / "tokenizer"))
    text = '{"true": false, "the": null} there is a string\nwith a newline<|end|>'
    assert tokenizer.encode(text) == expected.encode(text)
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.chat_template == CHAT_TEMPLATE
    messages = [{"role": "user", "content": "hi"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "user: hi\nassistant:"
    assert tokenizer.eos_token_id == EOS_TOKEN_ID
    # The file's end token, not the architecture's default (Llama's config would say 2).
    generation_config = json.loads((directory / "generation_config.json").read_text())
    assert generation_config["eos_token_id"] == EOS_TOKEN_ID
    assert config.eos_token_id == EOS_TOKEN_ID


def test_a_file_without_an_output_tensor_gives_a_model_with_a_tied_lm_head(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    tied = _tied_copy(checkpoints["qwen3"], tmp_path / "tied")
    path = write_gguf(tied, tmp_path / "tied.gguf")
    assert "output.weight" not in {t.name for t in gguf.GGUFReader(path).tensors}
    directory = resolve_model(str(path), tmp_path / "cache").directory
    assert AutoConfig.from_pretrained(directory).tie_word_embeddings
    with safe_open(str(directory / "model.safetensors"), "pt") as weights:
        assert "lm_head.weight" not in set(weights.keys())
    tokens, expected = _decode(_load(tied))
    logits = _forced_logits(_load(directory), PROMPT + tokens)
    assert _choices(logits) == tokens
    torch.testing.assert_close(logits, expected, rtol=0.0, atol=EXACT_ATOL)


def _tied_copy(checkpoint: Path, directory: Path) -> Path:
    """`checkpoint` with its LM head tied to the token embeddings (the separate head dropped)."""
    directory.mkdir(parents=True)
    config = json.loads((checkpoint / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    weights = {
        name: t for name, t in load_file(str(checkpoint / "model.safetensors")).items() if name != "lm_head.weight"
    }
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def _truncated_in_tensor_data(checkpoint: Path, good: Path, path: Path) -> None:
    data = good.read_bytes()
    path.write_bytes(data[: len(data) - len(data) // 3])  # the weights take most of the file; its header is intact


def _not_gguf(checkpoint: Path, good: Path, path: Path) -> None:
    path.write_text("this is a text file, not a model\n" * 20)


def _bloom(checkpoint: Path, good: Path, path: Path) -> None:
    write_gguf(checkpoint, path, architecture="bloom")


def _q8_1_tensor(checkpoint: Path, good: Path, path: Path) -> None:
    # Q8_1 is a type llama.cpp quantizes activations to; gguf-py has no dequantizer for it.
    write_gguf(checkpoint, path, raw_types={"blk.0.ffn_up.weight": gguf.GGMLQuantizationType.Q8_1})


# case -> (writes the bad file from the checkpoint and its good GGUF file, the reason the start-up error gives)
BAD_FILES: dict[str, tuple[Callable[[Path, Path, Path], None], str]] = {
    "truncated": (_truncated_in_tensor_data, "as a GGUF file (truncated or damaged?)"),
    "not-gguf": (_not_gguf, "is not a GGUF file (it does not start with the GGUF magic bytes)"),
    "unsupported-architecture": (_bloom, "architecture 'bloom' is not supported"),
    "unsupported-tensor-type": (_q8_1_tensor, "tensor type(s) Q8_1 cannot be dequantized"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_serve_refuses_a_bad_gguf_file_with_status_2_and_the_reason(
    case: str, gguf_file: GGUFFactory, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    make, reason = BAD_FILES[case]
    bad = tmp_path / f"{case}.gguf"
    make(checkpoints["qwen3"], gguf_file("qwen3"), bad)
    cache = tmp_path / "cache"
    serve = ["serve", "--model", str(bad), "--port", "0", "--metrics-port", "-1", "--model-cache-dir", str(cache)]
    result = subprocess.run([str(CONSOLE_SCRIPT), *serve], capture_output=True, text=True, timeout=90)
    assert result.returncode == 2, result.stderr
    assert "cannot serve the model: " in result.stderr and str(bad) in result.stderr, result.stderr
    assert reason in result.stderr
    assert "listening" not in result.stderr
    assert [p for p in cache.iterdir() if p.is_dir()] == [], "a failed conversion leaves nothing in the cache"


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _delete(path: Path) -> None:
    path.unlink()


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


CORRUPTIONS: dict[str, tuple[str, Callable[[Path], None]]] = {
    "weights-truncated": ("model.safetensors", _truncate),
    "manifest-deleted": (MANIFEST, _delete),
    "weights-changed-same-size": ("model.safetensors", _flip_last_byte),
    "config-changed-same-size": ("config.json", _flip_last_byte),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_damaged_model_cache_is_rebuilt_and_then_reused(
    corruption: str, gguf_file: GGUFFactory, reference: Callable[[str, str], Decode], tmp_path: Path
) -> None:
    source, cache = str(gguf_file("qwen3")), tmp_path / "cache"
    first = resolve_model(source, cache)
    converted_weights = (first.directory / "model.safetensors").read_bytes()
    name, damage = CORRUPTIONS[corruption]
    size = (first.directory / name).stat().st_size
    damage(first.directory / name)
    if corruption.endswith("same-size"):
        assert (first.directory / name).stat().st_size == size

    rebuilt = resolve_model(source, cache)
    assert rebuilt.converted and not rebuilt.cached
    assert rebuilt.directory == first.directory
    assert (rebuilt.directory / "model.safetensors").read_bytes() == converted_weights
    tokens, _ = reference("qwen3", "F32")
    assert _choices(_forced_logits(_load(rebuilt.directory), PROMPT + tokens)) == tokens

    reused = resolve_model(source, cache)
    assert reused.cached and not reused.converted
    assert reused.directory == first.directory


def test_an_intact_model_cache_is_reused_without_converting_again(gguf_file: GGUFFactory, tmp_path: Path) -> None:
    source, cache = str(gguf_file("llama")), tmp_path / "cache"
    first = resolve_model(source, cache)
    written_ns = (first.directory / "model.safetensors").stat().st_mtime_ns
    second = resolve_model(source, cache)
    assert (first.converted, first.cached) == (True, False)
    assert (second.converted, second.cached) == (False, True)
    assert second.directory == first.directory
    assert (second.directory / "model.safetensors").stat().st_mtime_ns == written_ns


def test_prepare_model_prints_the_converted_directory_and_reuses_it_on_a_second_run(
    gguf_file: GGUFFactory, tmp_path: Path
) -> None:
    source, cache = gguf_file("llama"), tmp_path / "cache"
    command = [str(CONSOLE_SCRIPT), "prepare-model", "--model", str(source), "--model-cache-dir", str(cache)]
    first = subprocess.run(command, capture_output=True, text=True, timeout=90)
    assert first.returncode == 0, first.stderr
    directory = Path(first.stdout.strip())
    assert directory.parent == cache and (directory / MANIFEST).is_file() and (directory / "config.json").is_file()
    assert "converting GGUF file" in first.stderr
    written_ns = (directory / "model.safetensors").stat().st_mtime_ns

    second = subprocess.run(command, capture_output=True, text=True, timeout=90)
    assert second.returncode == 0, second.stderr
    assert Path(second.stdout.strip()) == directory
    assert "model cache reused" in second.stderr and "converting GGUF file" not in second.stderr
    assert (directory / "model.safetensors").stat().st_mtime_ns == written_ns
