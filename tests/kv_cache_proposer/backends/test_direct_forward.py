"""The torch verifier's direct forward against transformers' modules: the same values, bit for bit, in float32,
but for a block over a long history, which attends in two parts and agrees within float rounding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, MistralConfig, PretrainedConfig, Qwen2Config

from inference_engine.config import ConfigError, ServerConfig
from kv_cache_proposer.backends.torch_backend import direct as direct_module
from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from kv_cache_proposer.strategies import FullStrategy, SinkWindowStrategy
from kv_cache_proposer.verifier import BatchBlock
from tests.support.checkpoints import COMMON_SHAPE
from tests.support.decoding import DECODE_STRATEGIES, PROPOSERS, SAMPLINGS, decode, proposer_options, random_tokens

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

_SHAPE = {**COMMON_SHAPE, "initializer_range": 0.1}

# Two more architectures the direct forward serves, beside the suite's qwen3 and llama: Qwen2 (biased Q/K/V
# projections, here with sliding and full layers mixed) and Mistral (every layer sliding).
_EXTRA: dict[str, PretrainedConfig] = {
    "qwen2": Qwen2Config(
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=1,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        **_SHAPE,
    ),
    "mistral": MistralConfig(sliding_window=6, head_dim=16, **_SHAPE),
}

STRATEGIES = {"full": FullStrategy(), "sink": SinkWindowStrategy(sink=2, window=8)}


@pytest.fixture(scope="module")
def model_dirs(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("direct")
    dirs = {arch: checkpoints[arch] for arch in ("qwen3", "llama", "gemma3")}
    for arch, config in _EXTRA.items():
        torch.manual_seed(5)
        AutoModelForCausalLM.from_config(config).save_pretrained(root / arch)
        dirs[arch] = root / arch
    return dirs


def _pair(model_dir: Path) -> tuple[TorchVerifier, TorchVerifier]:
    """The library-forward and direct-forward verifiers of one checkpoint, sharing the model's weights."""
    library = TorchVerifier.load(model_dir, device="cpu", dtype="float32", forward="library")
    direct = TorchVerifier(library.model, device=library.device, dtype=library.dtype)
    assert direct.forward_path == "direct" and library.forward_path.startswith("transformers modules")
    return library, direct


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2", "mistral"])
@pytest.mark.parametrize("strategy", list(STRATEGIES.values()), ids=list(STRATEGIES))
def test_every_forward_of_a_session_gives_the_library_values_bit_for_bit(model_dirs, arch, strategy):
    library, direct = _pair(model_dirs[arch])
    layers = (0, library.num_layers - 1)
    caches = [library.new_cache(strategy), direct.new_cache(strategy)]
    tokens = random_tokens(1, 40)
    # (block, logits rows, positions committed): a first chunk, a chunk over history with a rejected tail,
    # then single-token steps past the window
    blocks = [(tokens[:10], 10, 10), (tokens[10:17], 7, 5), *[([t], 1, 1) for t in tokens[17:32]]]
    for block, rows, keep in blocks:
        outs = [v.verify(c, block, rows, feature_layers=layers) for v, c in zip((library, direct), caches, strict=True)]
        assert torch.equal(outs[0].logits, outs[1].logits)
        assert outs[0].features is not None and outs[1].features is not None
        assert torch.equal(outs[0].features, outs[1].features)
        for verifier, cache in zip((library, direct), caches, strict=True):
            verifier.commit(cache, keep)
    for layer in range(library.num_layers):
        k1, v1, p1 = caches[0].resident_kv(layer)
        k2, v2, p2 = caches[1].resident_kv(layer)
        assert p1.tolist() == p2.tolist() and torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_a_batched_forward_gives_the_library_values_bit_for_bit(model_dirs, arch):
    library, direct = _pair(model_dirs[arch])
    results = []
    for verifier in (library, direct):
        decoding, fresh = verifier.new_cache(FullStrategy()), verifier.new_cache(SinkWindowStrategy(sink=2, window=8))
        verifier.verify(decoding, random_tokens(2, 12), 1)
        verifier.commit(decoding, 12)
        blocks = [BatchBlock(decoding, [5], 1), BatchBlock(fresh, random_tokens(3, 9), 2)]
        results.append(verifier.verify_batch(blocks, feature_layers=(1,)))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a.logits, b.logits) and torch.equal(a.features, b.features)


@pytest.mark.parametrize("split", ["long histories", "every history"])
@pytest.mark.parametrize("proposer", PROPOSERS)
@pytest.mark.parametrize("strategy", list(DECODE_STRATEGIES.values()), ids=list(DECODE_STRATEGIES))
def test_decoding_gives_the_same_tokens_through_either_forward(
    model_dirs, tmp_path, monkeypatch, proposer, strategy, split
):
    if split == "every history":  # every block over earlier keys of an unbounded cache attends in two parts
        monkeypatch.setattr(direct_module, "SPLIT_MIN_PAIRS", 1)
    options = proposer_options(proposer, tmp_path)
    library, direct = _pair(model_dirs["qwen3"])
    for params in SAMPLINGS:
        tokens = decode(library, "torch", strategy, options, params)
        assert decode(direct, "torch", strategy, options, params) == tokens
        assert len(set(tokens)) > 3


def test_a_block_over_a_long_history_attends_in_two_parts_within_float_rounding(model_dirs, monkeypatch):
    library, direct = _pair(model_dirs["qwen3"])
    split_calls: list[tuple[int, ...]] = []
    attend = direct_module._attend_over_history

    def counted(q, *args):
        split_calls.append(tuple(q.shape))
        return attend(q, *args)

    monkeypatch.setattr(direct_module, "_attend_over_history", counted)
    history, block = random_tokens(1, 1100), random_tokens(2, 128)  # 128 queries x 1,100 earlier keys: split
    layers = (0, library.num_layers - 1)
    outs, caches = [], []
    for verifier in (library, direct):
        cache = verifier.new_cache(FullStrategy())
        verifier.verify(cache, history, 1)  # no earlier keys: the kernel's causal mask, bit for bit
        verifier.commit(cache, len(history))
        outs.append(verifier.verify(cache, block, len(block), feature_layers=layers))
        verifier.commit(cache, len(block))
        caches.append(cache)
    assert split_calls == [(1, 4, 128, 16)] * library.num_layers
    torch.testing.assert_close(outs[1].logits, outs[0].logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1].features, outs[0].features, rtol=1e-5, atol=1e-5)
    assert outs[1].logits.argmax(-1).tolist() == outs[0].logits.argmax(-1).tolist()
    k1, v1, _ = caches[0].resident_kv(library.num_layers - 1)
    k2, v2, _ = caches[1].resident_kv(library.num_layers - 1)
    torch.testing.assert_close(k2, k1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v2, v1, rtol=1e-5, atol=1e-5)
    assert direct._direct.splits(16, 8192) and not direct._direct.splits(16, 4096)
    assert not direct._direct.splits(1, 100_000)


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(("n", "earlier"), [(2, 1), (7, 300), (64, 33)])
def test_the_split_attention_is_the_masked_attention(groups, dtype, tolerance, n, earlier):
    torch.manual_seed(n + earlier)
    kv_heads, dim = 2, 16
    q = torch.randn(1, n, kv_heads * groups, dim, dtype=dtype).transpose(1, 2)  # the layout the forward gives
    keys, values = (torch.randn(1, kv_heads, earlier + n, dim, dtype=dtype) for _ in range(2))
    layer = direct_module._Layer((), (), "full_attention", groups, dim, dim**-0.5)
    visible = torch.arange(earlier + n)[None, :] <= torch.arange(earlier, earlier + n)[:, None]  # [n, K]
    expected = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=visible[None, None], scale=layer.scaling, enable_gqa=True
    )
    got = direct_module._attend(q, keys, values, direct_module.OVER_HISTORY, layer)
    assert got.dtype == dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    with pytest.raises(ValueError, match="needs keys before its own"):
        direct_module._attend(q, keys[:, :, earlier:], values[:, :, earlier:], direct_module.OVER_HISTORY, layer)


def test_other_models_run_through_transformers_modules(model_dirs):
    gemma = TorchVerifier.load(model_dirs["gemma3"], device="cpu", dtype="float32")
    assert gemma.forward_path.startswith("transformers modules (model type gemma3")
    assert gemma.description.endswith(f"forward: {gemma.forward_path}")
    eager = AutoModelForCausalLM.from_pretrained(model_dirs["qwen3"], attn_implementation="eager")
    verifier = TorchVerifier(eager, device=torch.device("cpu"), dtype=torch.float32)
    expected = "transformers modules (attention implementation eager (the direct forward uses sdpa))"
    assert verifier.forward_path == expected
    with pytest.raises(ValueError, match="unknown forward 'compiled'"):
        TorchVerifier(eager, device=torch.device("cpu"), dtype=torch.float32, forward="compiled")


def test_the_torch_forward_option_belongs_to_the_torch_backend():
    assert ServerConfig(torch_forward="library").torch_forward == "library"
    with pytest.raises(ConfigError, match="torch_forward library applies to the torch backend, not mlx"):
        ServerConfig(backend="mlx", torch_forward="library")
    with pytest.raises(ConfigError, match="torch_forward"):
        ServerConfig(torch_forward="fast")
