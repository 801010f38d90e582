"""The torch verifier's decode steps compiled by torch.compile (`compile="on"`): the greedy tokens of the scripted
steps for every proposer and strategy, values within float rounding, a compile time logged and graphs in the
inductor cache; a failed compilation is a warning, and the steps run scripted."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch._inductor.config as inductor_config

from kv_cache_proposer.backends import load_verifier
from kv_cache_proposer.backends.torch_backend.direct import COMPILED_MAX_QUERIES
from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import FullStrategy, SinkWindowStrategy
from kv_cache_proposer.verifier import BatchBlock
from tests.support.decoding import DECODE_STRATEGIES, PROPOSERS, decode, proposer_options, random_tokens

pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(
        shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor compiles C++ on a CPU"
    ),
]

_VERIFIER_LOG = "kv_cache_proposer.backends.torch_backend.verifier"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh inductor cache for the module, named by the variable the daemon honours."""
    directory = tmp_path_factory.mktemp("inductor")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(directory))
        yield directory


@pytest.fixture(scope="module")
def pair(
    checkpoints: dict[str, Path], inductor_cache: Path, one_torch_thread: None
) -> tuple[TorchVerifier, TorchVerifier, list[logging.LogRecord]]:
    """The scripted and the compiled verifier of the qwen3 checkpoint, sharing its weights, and what compiling
    logged (compiled once for the module: it takes seconds)."""
    scripted = TorchVerifier.load(checkpoints["qwen3"], device="cpu", dtype="float32")
    logger, handler = logging.getLogger(_VERIFIER_LOG), _Records()
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        compiled = TorchVerifier(scripted.model, device=scripted.device, dtype=scripted.dtype, compile="on")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return scripted, compiled, handler.records


def test_the_compiled_verifier_says_so_and_logs_its_compile_time(pair, inductor_cache):
    scripted, compiled, records = pair
    assert compiled.compiled and compiled.description.endswith("forward: direct, compiled")
    assert not scripted.compiled and scripted.description.endswith("forward: direct")
    (record,) = [r for r in records if r.getMessage().startswith("compiled the decode step in")]
    assert record.levelno == logging.INFO and record.compile_s > 0
    assert record.getMessage().endswith(f"(inductor cache: {inductor_cache})")
    assert compiled.compile_s is not None and compiled.compile_s > 0 and scripted.compile_s is None
    assert any(inductor_cache.rglob("*.py")), "the compiled graphs are in the inductor cache named"


@pytest.mark.parametrize("proposer", PROPOSERS)
@pytest.mark.parametrize("strategy", list(DECODE_STRATEGIES.values()), ids=list(DECODE_STRATEGIES))
def test_decoding_gives_the_scripted_greedy_tokens_compiled(pair, tmp_path, proposer, strategy):
    scripted, compiled, _ = pair
    options = proposer_options(proposer, tmp_path)
    tokens = decode(scripted, "torch", strategy, options, SamplingParams())
    assert decode(compiled, "torch", strategy, options, SamplingParams()) == tokens
    assert len(set(tokens)) > 3


def test_compiled_steps_agree_with_scripted_within_float_rounding(pair):
    scripted, compiled, _ = pair
    layers = (0, scripted.num_layers - 1)
    outputs = []
    for verifier in (scripted, compiled):
        cache = verifier.new_cache(SinkWindowStrategy(sink=2, window=8))
        verifier.verify(cache, random_tokens(1, 30), 1)
        verifier.commit(cache, 30)
        single = verifier.verify(cache, [7], 1, feature_layers=layers)
        verifier.commit(cache, 1)
        block = verifier.verify(cache, random_tokens(2, 5), 5, feature_layers=layers)
        verifier.commit(cache, 5)
        fresh = verifier.new_cache(FullStrategy())
        batch = verifier.verify_batch([BatchBlock(cache, [9], 1), BatchBlock(fresh, random_tokens(3, 6), 2)])
        outputs.append([single.logits, single.features, block.logits, block.features, *(o.logits for o in batch)])
    for got, expected in zip(outputs[1], outputs[0], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_a_block_longer_than_the_compiled_limit_runs_the_scripted_steps(pair):
    scripted, compiled, _ = pair
    prompt = random_tokens(5, COMPILED_MAX_QUERIES + 1)
    logits = [v.verify(v.new_cache(FullStrategy()), prompt, len(prompt)).logits for v in (scripted, compiled)]
    assert torch.equal(logits[0], logits[1]), "a prefill chunk runs the scripted steps: the same values bit for bit"


def test_load_verifier_compiles_when_asked(pair, checkpoints):
    verifier = load_verifier("torch", checkpoints["qwen3"], device="cpu", dtype="float32", compile="on")
    assert isinstance(verifier, TorchVerifier) and verifier.compiled
    assert not TorchVerifier(verifier.model, device=verifier.device, dtype=verifier.dtype, compile="off").compiled
    with pytest.raises(ValueError, match="unknown compile 'always'"):
        load_verifier("torch", checkpoints["qwen3"], device="cpu", dtype="float32", compile="always")


def test_a_failed_compilation_logs_why_and_decodes_with_the_scripted_steps(checkpoints, tmp_path, monkeypatch, caplog):
    # a model no other test compiles, an empty cache and no C++ compiler: inductor must compile, and fails
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    scripted = TorchVerifier.load(checkpoints["llama"], device="cpu", dtype="float32")
    no_compiler = inductor_config.patch({"cpp.cxx": ("no-such-c++-compiler",)})
    with caplog.at_level(logging.WARNING, logger=_VERIFIER_LOG), no_compiler:
        failed = TorchVerifier(scripted.model, device=scripted.device, dtype=scripted.dtype, compile="on")
    (record,) = [r for r in caplog.records if "compiling the decode step failed" in r.getMessage()]
    assert record.levelno == logging.WARNING and "no-such-c++-compiler" in record.getMessage()
    assert not failed.compiled and failed.compile_s is None
    assert failed.description.endswith("forward: direct (compilation failed: InductorError)")
    options = proposer_options("ngram", tmp_path)
    strategy = FullStrategy()
    assert decode(failed, "torch", strategy, options, SamplingParams()) == decode(
        scripted, "torch", strategy, options, SamplingParams()
    )


def test_compile_on_for_a_model_through_transformers_modules_warns(checkpoints, caplog):
    with caplog.at_level(logging.WARNING, logger=_VERIFIER_LOG):
        gemma = TorchVerifier.load(checkpoints["gemma3"], device="cpu", dtype="float32", compile="on")
    assert not gemma.compiled
    (record,) = caplog.records
    assert record.getMessage().startswith("compile on: not compiled, the forward runs through transformers modules")
