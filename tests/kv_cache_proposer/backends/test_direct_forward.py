"""The torch verifier's direct forward: transformers' values within float rounding, and on a CPU, a token's values
bit for bit whatever the shape of the blocks that delivered its history and whatever rows share its forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, MistralConfig, PretrainedConfig, Qwen2Config

from inference_engine.config import ConfigError, ServerConfig
from kv_cache_proposer.backends.torch_backend import direct as direct_module
from kv_cache_proposer.backends.torch_backend import exact_attention as exact_module
from kv_cache_proposer.backends.torch_backend.arrays import TorchArrayOps
from kv_cache_proposer.backends.torch_backend.exact_attention import KEY_BLOCK
from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from kv_cache_proposer.strategies import FullStrategy, KVStrategy, SinkWindowStrategy
from kv_cache_proposer.verifier import BatchBlock
from tests.support.checkpoints import COMMON_SHAPE
from tests.support.decoding import (
    BOUNDED,
    DECODE_STRATEGIES,
    DELIVERIES,
    PROPOSERS,
    SAMPLINGS,
    decode,
    delivered_values,
    proposer_options,
    random_tokens,
)

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


def _pair(model_dir: Path, forward: str = "auto") -> tuple[TorchVerifier, TorchVerifier]:
    """The library-forward and direct-forward verifiers of one checkpoint, sharing the model's weights."""
    library = TorchVerifier.load(model_dir, device="cpu", dtype="float32", forward="library")
    direct = TorchVerifier(library.model, device=library.device, dtype=library.dtype, forward=forward)
    assert direct.forward_path == ("direct" if forward == "auto" else "direct, fast kernels")
    assert library.forward_path.startswith("transformers modules")
    return library, direct


@pytest.mark.parametrize("forward", ["auto", "fast"])
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2", "mistral"])
@pytest.mark.parametrize("strategy", list(STRATEGIES.values()), ids=list(STRATEGIES))
def test_every_forward_of_a_session_gives_the_library_values(model_dirs, arch, strategy, forward):
    """Within float rounding: the direct forward sums attention and float32 products in an order of its own on a
    CPU (whole key blocks, padded rows; fast: each shape's fastest kernel), which the library does not."""
    library, direct = _pair(model_dirs[arch], forward)
    layers = (0, library.num_layers - 1)
    caches = [library.new_cache(strategy), direct.new_cache(strategy)]
    tokens = random_tokens(1, 40)
    # (block, logits rows, positions committed): a first chunk, a chunk over history with a rejected tail,
    # then single-token steps past the window
    blocks = [(tokens[:12], 12, 12), (tokens[12:20], 8, 5), *[([t], 1, 1) for t in tokens[20:32]]]
    for block, rows, keep in blocks:
        outs = [v.verify(c, block, rows, feature_layers=layers) for v, c in zip((library, direct), caches, strict=True)]
        assert outs[0].features is not None and outs[1].features is not None
        torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(outs[1].features, outs[0].features, atol=1e-5, rtol=1e-5)
        for verifier, cache in zip((library, direct), caches, strict=True):
            verifier.commit(cache, keep)
    for layer in range(library.num_layers):
        k1, v1, p1 = caches[0].resident_kv(layer)
        k2, v2, p2 = caches[1].resident_kv(layer)
        assert p1.tolist() == p2.tolist()
        torch.testing.assert_close(k2, k1, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v2, v1, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("weights", ["float32", "int4"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "mistral"])
def test_a_batched_forward_gives_every_row_its_own_forward_bit_for_bit(model_dirs, arch, threads, weights):
    """Each row of a batched forward attends over its own keys through the calls its block alone makes, and every
    float32 product's rows are padded to a multiple of 4: a row's values do not depend on the rows beside it."""
    verifier = TorchVerifier.load(model_dirs[arch], device="cpu", dtype="float32", weights=weights)
    assert verifier.forward_path == "direct"
    # (history, block, logits rows): decode steps over histories of several lengths, a speculative block, a
    # prefill chunk over history and a first chunk
    rows = [(13, 1, 1), (40, 1, 1), (29, 6, 6), (3, 1, 1), (20, 33, 1), (0, 9, 2)]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for width in (2, 4, len(rows)):
            caches, blocks = [], []
            for seed, (history, length, logits_rows) in enumerate(rows[:width]):
                caches.append([verifier.new_cache(FullStrategy()) for _ in range(2)])
                for cache in caches[-1]:
                    if history:
                        verifier.verify(cache, random_tokens(seed, history), 1)
                        verifier.commit(cache, history)
                blocks.append(BatchBlock(caches[-1][1], random_tokens(50 + seed, length), logits_rows))
            alone = [
                verifier.verify(pair[0], b.token_ids, b.logits_rows, feature_layers=(1,))
                for pair, b in zip(caches, blocks, strict=True)
            ]
            batched = verifier.verify_batch(blocks, feature_layers=(1,))
            for a, b in zip(alone, batched, strict=True):
                assert torch.equal(a.logits, b.logits) and torch.equal(a.features, b.features)
            for (first, second), block in zip(caches, blocks, strict=True):
                for cache in (first, second):
                    verifier.commit(cache, len(block.token_ids))
                for layer in range(verifier.num_layers):
                    k1, v1, _ = first.resident_kv(layer)
                    k2, v2, _ = second.resident_kv(layer)
                    assert torch.equal(k1, k2) and torch.equal(v1, v2)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("forward", ["auto", "fast"])
@pytest.mark.parametrize("proposer", PROPOSERS)
@pytest.mark.parametrize("strategy", list(DECODE_STRATEGIES.values()), ids=list(DECODE_STRATEGIES))
def test_decoding_gives_the_same_tokens_through_either_forward(model_dirs, tmp_path, proposer, strategy, forward):
    options = proposer_options(proposer, tmp_path)
    library, direct = _pair(model_dirs["qwen3"], forward)
    for params in SAMPLINGS:
        tokens = decode(library, "torch", strategy, options, params)
        assert decode(direct, "torch", strategy, options, params) == tokens
        assert len(set(tokens)) > 3


@pytest.mark.parametrize("weights", ["float32", "int4"])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_history_gives_the_same_values_however_it_was_delivered(model_dirs, weights, threads):
    _assert_delivery_invariant(model_dirs["qwen3"], FullStrategy(), weights, threads)


@pytest.mark.parametrize("weights", ["float32", "int4"])
@pytest.mark.parametrize("strategy", list(BOUNDED.values()), ids=list(BOUNDED))
def test_a_bounded_cache_s_history_gives_the_same_values_however_it_was_delivered(model_dirs, strategy, weights):
    _assert_delivery_invariant(model_dirs["qwen3"], strategy, weights, 2)


def _assert_delivery_invariant(model_dir: Path, strategy: KVStrategy, weights: str, threads: int) -> None:
    """Every way of `DELIVERIES` leaves the same resident K/V and gives the next block the same logits and
    features, bit for bit."""
    verifier = TorchVerifier.load(model_dir, device="cpu", dtype="float32", weights=weights)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        results = {name: delivered_values(verifier, strategy, sizes) for name, sizes in DELIVERIES.items()}
    finally:
        torch.set_num_threads(previous)
    expected = results["one block"]
    for name, got in results.items():
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), name


@pytest.mark.parametrize("groups", [1, 2, 3, 4])
@pytest.mark.parametrize("room", ["spare slots", "after the pair", "none"])
def test_a_query_s_attention_does_not_depend_on_its_block(groups, room, attention_path):
    torch.manual_seed(groups)
    kv_heads, dim, total = 2, 16, 1300
    q = torch.randn(1, total, kv_heads * groups, dim).transpose(1, 2)  # the layout the forward gives
    if room == "after the pair":  # a cache's buffers: keys, values and room for whole key blocks in one allocation
        like = torch.empty(1, kv_heads, 0, dim)
        keys, values = TorchArrayOps(torch.device("cpu")).alloc_pair(like, like, total, KEY_BLOCK - 1)
        keys.copy_(torch.randn_like(keys))
        values.copy_(torch.randn_like(values))
    else:
        buffer = torch.randn(2, 1, kv_heads, 2048 if room == "spare slots" else total, dim)
        keys, values = buffer[0][:, :, :total], buffer[1][:, :, :total]
    layer = direct_module._Layer((), (), "full_attention", groups, dim, dim**-0.5)

    def delivered(sizes: list[int]) -> torch.Tensor:
        outputs, start = [], 0
        for size in sizes:
            end = start + size
            mask = None if start == 0 else direct_module.OVER_HISTORY
            row_q, row_k, row_v = q[:, :, start:end], keys[:, :, :end], values[:, :, :end]
            outputs.append(direct_module._attend(row_q, row_k, row_v, mask, layer, {}))
            start = end
        return torch.cat(outputs, dim=2)

    expected = delivered([total])
    visible = torch.ones(total, total, dtype=torch.bool).tril()
    reference = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[None, None], enable_gqa=True)
    torch.testing.assert_close(expected, reference, rtol=2e-6, atol=2e-6)
    for sizes in ([1] * 40 + [1260], [512, 511, 1, 276], [3, 700, 597], [100] * 13):
        assert torch.equal(delivered(sizes), expected), sizes


@pytest.mark.parametrize(("capacity", "in_place"), [(1300, True), (300, False)])
def test_attention_reads_whole_key_blocks_of_a_pair_of_buffers_in_place_where_their_room_reaches(capacity, in_place):
    """Keys and values with room after them (`alloc_pair`) are read up to a whole key block as views of their own
    allocation, every slot past the end zero or another head's; without room (where it would cost more than an
    eighth of the pair) they are padded copies."""
    like = torch.empty(1, 3, 0, 8)
    ops = TorchArrayOps(torch.device("cpu"))
    keys, values = ops.alloc_pair(like, like, capacity, KEY_BLOCK - 1)
    keys.copy_(torch.randn_like(keys))
    values.copy_(torch.randn_like(values))
    room = (KEY_BLOCK - 1) * 8 * 4 if in_place else 0
    assert ops.pair_nbytes(keys, values) == 2 * keys.numel() * 4 + room
    length = capacity + (-capacity) % KEY_BLOCK
    for buffer in (keys, values):
        read = exact_module._with_room(buffer, length)
        assert read.shape == (1, 3, length, 8) and torch.equal(read[:, :, :capacity], buffer)
        assert (read.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()) == in_place
        assert torch.isfinite(read).all()
    assert torch.equal(exact_module._with_room(values, length)[0, 2, capacity:], torch.zeros(length - capacity, 8))


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(("n", "earlier"), [(1, 9), (2, 1), (7, 300), (64, 33)])
def test_the_attention_of_a_block_over_its_history_is_the_masked_attention(
    groups, dtype, tolerance, n, earlier, attention_path
):
    torch.manual_seed(n + earlier)
    kv_heads, dim = 2, 16
    q = torch.randn(1, n, kv_heads * groups, dim, dtype=dtype).transpose(1, 2)  # the layout the forward gives
    keys, values = (torch.randn(1, kv_heads, earlier + n, dim, dtype=dtype) for _ in range(2))
    layer = direct_module._Layer((), (), "full_attention", groups, dim, dim**-0.5)
    visible = torch.arange(earlier + n)[None, :] <= torch.arange(earlier, earlier + n)[:, None]  # [n, K]
    expected = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=visible[None, None], scale=layer.scaling, enable_gqa=True
    )
    for mask in (direct_module.OVER_HISTORY, visible[None, None]):
        got = direct_module._attend(q, keys, values, mask, layer, {})
        assert got.dtype == dtype and got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


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
    assert ServerConfig(torch_forward="fast").torch_forward == "fast"
    with pytest.raises(ConfigError, match="torch_forward"):
        ServerConfig(torch_forward="quick")


def test_without_onednn_s_product_float32_runs_the_default_product_and_says_so(model_dirs, monkeypatch, caplog):
    from kv_cache_proposer.backends.torch_backend import weights

    monkeypatch.setattr(weights, "_EXACT_PRODUCT", False)
    weights._warn_inexact.cache_clear()
    with caplog.at_level("WARNING", logger=weights.__name__):
        verifier = TorchVerifier.load(model_dirs["qwen3"], device="cpu", dtype="float32")
    assert "no oneDNN linear operator" in caplog.text
    direct = verifier._direct
    assert direct is not None and direct._layers[0].inputs[2][0][3] == weights.DENSE
    cache = verifier.new_cache(FullStrategy())
    assert verifier.verify(cache, random_tokens(3, 9), 1).logits.isfinite().all()
    weights._warn_inexact.cache_clear()
