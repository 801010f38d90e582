"""Attention over K/V held as lattice coordinates (torch): the keys' decoded values attended densely, within float
rounding, read in chunks of 1, 7 and more than the history, with and without a causal block after them and with
positions no query may read, for every K/V head grouping; both ways a block reads them (the coordinates
themselves, or, for a block of many queries, each chunk decoded); and as a generating packed session reads them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kv_cache_proposer.backends.torch_backend import held_attention, held_kernel
from kv_cache_proposer.backends.torch_backend.chunked_attention import attend_parts
from kv_cache_proposer.backends.torch_backend.lattice_codec import TorchLatticeCodec
from kv_cache_proposer.compression.lattice import LatticeSpec
from tests.kv_cache_proposer.backends.test_chunked_attention import _reference
from tests.support.compilers import kernel_without_avx512, use_broken_compiler

HISTORY, QUERIES, DIM, KV_HEADS = 37, 5, 16, 2
PATHS = ["kernel", "scripted", "decoded"]


def _read(monkeypatch: pytest.MonkeyPatch, path: str, chunk: int) -> None:
    """Make every block read held keys `path`'s way, `chunk` keys at a time: the coordinates themselves by the
    compiled kernel (in segments of `chunk`) or by TorchScript ops, or each chunk decoded."""
    monkeypatch.setattr(held_attention, "HELD_CHUNK", chunk)
    monkeypatch.setattr(held_attention, "DECODED_CHUNK", chunk)
    monkeypatch.setattr(held_kernel, "SEGMENT", chunk)
    monkeypatch.setattr(held_attention, "DECODED_QUERIES", 1 if path == "decoded" else 1 << 30)
    if path == "kernel":
        _require_kernel()
    else:
        monkeypatch.setattr(held_kernel, "serves", lambda *args: False)


def _require_kernel() -> None:
    if held_kernel.held_kernel() is None:
        pytest.skip("no C compiler here to build the held-attention kernel; the TorchScript path is tested instead")


def _held(codec: TorchLatticeCodec, keys: torch.Tensor, values: torch.Tensor) -> held_attention.TorchHeldKeys:
    """`keys`/`values` coded as a generating packed layer holds them (int8 doubled coordinates)."""
    _, _, coding = codec.code_blocks([(keys, values)], torch.float32)[0]
    doubled = coding.doubled.to(codec.coordinate_dtype())
    return codec.held_keys(type(coding)(doubled, coding.norms, coding.qmax), torch.float32)


@pytest.mark.parametrize("kind", ["d4", "e8"])
@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 64])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("hole", [True, False], ids=["a-slot-no-query-reads", "every-held-key-readable"])
def test_held_keys_attend_as_their_decoded_values_do(monkeypatch, kind, groups, causal, chunk, path, hole):
    _read(monkeypatch, path, chunk)
    rng = np.random.default_rng(groups * 10 + chunk)
    q = torch.from_numpy(rng.standard_normal((1, KV_HEADS * groups, QUERIES, DIM)).astype(np.float32))
    keys, values = (torch.from_numpy(rng.standard_normal((1, KV_HEADS, HISTORY, DIM)).astype(np.float32)) for _ in "kv")
    own_keys, own_values = (
        torch.from_numpy(rng.standard_normal((1, KV_HEADS, QUERIES, DIM)).astype(np.float32)) for _ in "kv"
    )
    codec = TorchLatticeCodec(LatticeSpec(kind, DIM, 19), torch.device("cpu"))
    held = _held(codec, keys, values)
    decoded_keys, decoded_values = held.dense()
    allowed = np.ones((QUERIES, HISTORY + QUERIES), dtype=bool)
    if hole:
        allowed[:, 3] = False  # a slot no query reads (an empty ring slot, say)
    if causal:
        allowed[:, HISTORY:] = np.tril(np.ones((QUERIES, QUERIES), dtype=bool))
    scale = DIM**-0.5
    everything = (torch.cat([decoded_keys, own_keys], 2), torch.cat([decoded_values, own_values], 2))
    expected = _reference(q.numpy(), everything[0].numpy(), everything[1].numpy(), allowed, scale)
    mask = torch.from_numpy(allowed)
    together = attend_parts(q, [held, (own_keys, own_values)], mask, scale=scale)  # the stage read in the same pass
    np.testing.assert_allclose(together.numpy(), expected, atol=3e-5, rtol=3e-5)
    prefix = (decoded_keys[:, :, :4], decoded_values[:, :, :4])  # a dense part ahead of a held one, merged after
    rest = _held(codec, keys[:, :, 4:], values[:, :, 4:])
    parts = attend_parts(q, [prefix, rest, (own_keys, own_values)], mask, scale=scale)
    rest_keys, rest_values = rest.dense()
    joined = (torch.cat([prefix[0], rest_keys, own_keys], 2), torch.cat([prefix[1], rest_values, own_values], 2))
    expected = _reference(q.numpy(), joined[0].numpy(), joined[1].numpy(), allowed, scale)
    np.testing.assert_allclose(parts.numpy(), expected, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("path", PATHS)
def test_a_query_that_may_read_no_held_key_reads_only_the_stage_and_one_that_reads_nothing_gets_zeros(
    monkeypatch, path
):
    _read(monkeypatch, path, 16)
    rng = np.random.default_rng(5)
    q = torch.from_numpy(rng.standard_normal((1, KV_HEADS, 2, DIM)).astype(np.float32))
    keys, values = (torch.from_numpy(rng.standard_normal((1, KV_HEADS, HISTORY, DIM)).astype(np.float32)) for _ in "kv")
    own_keys, own_values = (
        torch.from_numpy(rng.standard_normal((1, KV_HEADS, 2, DIM)).astype(np.float32)) for _ in "kv"
    )
    held = _held(TorchLatticeCodec(LatticeSpec("d4", DIM, 38), torch.device("cpu")), keys, values)
    allowed = np.zeros((2, HISTORY + 2), dtype=bool)
    allowed[1, HISTORY:] = True  # the second query reads only the stage; the first reads nothing
    out = attend_parts(q, [held, (own_keys, own_values)], torch.from_numpy(allowed), scale=DIM**-0.5)
    assert torch.all(out[:, :, 0] == 0)
    expected = _reference(q.numpy()[:, :, 1:], own_keys.numpy(), own_values.numpy(), allowed[1:, HISTORY:], DIM**-0.5)
    np.testing.assert_allclose(out[:, :, 1:].numpy(), expected, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("path", ["kernel", "scripted"])
@pytest.mark.parametrize("parallel", [0, 1 << 40], ids=["every-thread", "one-thread"])
def test_held_attention_gives_the_same_values_on_one_thread_or_all_and_leaves_the_thread_count(
    monkeypatch, parallel, path
):
    # Enough converted coordinates run on every thread, fewer on one (HELD_PARALLEL); the values are the same
    # either way and the caller's thread count is left as it was.
    _read(monkeypatch, path, 16)
    monkeypatch.setattr(held_attention, "HELD_PARALLEL", parallel)
    rng = np.random.default_rng(11)
    q = torch.from_numpy(rng.standard_normal((1, KV_HEADS * 3, 1, DIM)).astype(np.float32))
    keys, values = (torch.from_numpy(rng.standard_normal((1, KV_HEADS, HISTORY, DIM)).astype(np.float32)) for _ in "kv")
    held = _held(TorchLatticeCodec(LatticeSpec("d4", DIM, 38), torch.device("cpu")), keys, values)
    decoded_keys, decoded_values = held.dense()
    threads = torch.get_num_threads()
    out = attend_parts(q, [held], None, scale=DIM**-0.5)
    assert torch.get_num_threads() == threads
    allowed = np.ones((1, HISTORY), dtype=bool)
    expected = _reference(q.numpy(), decoded_keys.numpy(), decoded_values.numpy(), allowed, DIM**-0.5)
    np.testing.assert_allclose(out.numpy(), expected, atol=3e-5, rtol=3e-5)


def test_no_held_key_at_all_reads_only_the_tail():
    rng = np.random.default_rng(13)
    q = torch.from_numpy(rng.standard_normal((1, KV_HEADS * 2, 1, DIM)).astype(np.float32))
    own_keys, own_values = (
        torch.from_numpy(rng.standard_normal((1, KV_HEADS, 3, DIM)).astype(np.float32)) for _ in "kv"
    )
    codec = TorchLatticeCodec(LatticeSpec("d4", DIM, 38), torch.device("cpu"))
    held = _held(codec, own_keys[:, :, :0], own_values[:, :, :0])
    assert held.length == 0
    out = attend_parts(q, [held, (own_keys, own_values)], None, scale=DIM**-0.5)
    allowed = np.ones((1, 3), dtype=bool)
    expected = _reference(q.numpy(), own_keys.numpy(), own_values.numpy(), allowed, DIM**-0.5)
    np.testing.assert_allclose(out.numpy(), expected, atol=3e-5, rtol=3e-5)


def test_the_kernel_gives_the_same_bits_on_any_thread_count_and_a_query_alone_its_values_in_a_block(monkeypatch):
    # Segments at fixed boundaries, merged in order: how many threads run them cannot change a result's bits. A
    # query alone is scored key by key, in a block of many rows a tile at a time: the same values within rounding.
    _require_kernel()
    monkeypatch.setattr(held_kernel, "SEGMENT", 16)
    rng = np.random.default_rng(17)
    q = torch.from_numpy(rng.standard_normal((1, KV_HEADS * 3, 4, DIM)).astype(np.float32))
    keys, values = (torch.from_numpy(rng.standard_normal((1, KV_HEADS, 100, DIM)).astype(np.float32)) for _ in "kv")
    own = tuple(torch.from_numpy(rng.standard_normal((1, KV_HEADS, 4, DIM)).astype(np.float32)) for _ in "kv")
    held = _held(TorchLatticeCodec(LatticeSpec("d4", DIM, 38), torch.device("cpu")), keys, values)
    allowed = np.ones((4, 104), dtype=bool)
    allowed[:, 100:] = np.tril(np.ones((4, 4), dtype=bool))  # a causal block after the held keys
    mask = torch.from_numpy(allowed)
    threads = torch.get_num_threads()
    block = attend_parts(q, [held, own], mask, scale=DIM**-0.5)
    try:
        torch.set_num_threads(1)
        one_thread = attend_parts(q, [held, own], mask, scale=DIM**-0.5)
        alone = [
            attend_parts(
                q[:, :, i : i + 1], [held, (own[0][:, :, : i + 1], own[1][:, :, : i + 1])], None, scale=DIM**-0.5
            )
            for i in range(4)
        ]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(block, one_thread)
    np.testing.assert_allclose(block.numpy(), torch.cat(alone, dim=2).numpy(), atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("unit", ["tiles", "bf16-vectors"])
def test_a_block_s_rows_get_the_same_bits_however_many_rows_share_the_tile_unit_or_the_bf16_vectors(monkeypatch, unit):
    # On the tile unit up to 32 rows score the keys as they are converted, more transpose them first; on AVX512-BF16
    # vectors rows are scored and summed four at a time: the same products in the same order either way, so a row's
    # bits do not depend on which way its block took or on the rows beside it (in a block of 8 rows or more).
    _require_kernel()
    kernel = held_kernel.held_kernel()
    assert kernel is not None
    if unit == "tiles" and not kernel.tiles:
        pytest.skip("this CPU has no tile unit (AMX) for the kernel to use; the vector path is tested above")
    if unit == "bf16-vectors":
        if not kernel.bf16_products:
            pytest.skip("this CPU has no AVX512-BF16: a block's many rows are scored in float32 (tested above)")
        vectors = dataclasses.replace(kernel, tiles=False)
        monkeypatch.setattr(held_kernel, "held_kernel", lambda: vectors)
    rng = np.random.default_rng(5)
    queries, groups, dim, history = 12, 3, 64, 300
    q = torch.from_numpy(rng.standard_normal((1, KV_HEADS * groups, queries, dim)).astype(np.float32))
    keys, values = (torch.from_numpy(rng.standard_normal((1, KV_HEADS, history, dim)).astype(np.float32)) for _ in "kv")
    own = tuple(torch.from_numpy(rng.standard_normal((1, KV_HEADS, queries, dim)).astype(np.float32)) for _ in "kv")
    held = _held(TorchLatticeCodec(LatticeSpec("d4", dim, 38), torch.device("cpu")), keys, values)
    allowed = np.ones((queries, history + queries), dtype=bool)
    allowed[:, history:] = np.tril(np.ones((queries, queries), dtype=bool))
    mask = torch.from_numpy(allowed)
    whole = attend_parts(q, [held, own], mask, scale=dim**-0.5)  # 36 rows a K/V head
    parts = [attend_parts(q[:, :, i : i + 4], [held, own], mask[i : i + 4], scale=dim**-0.5) for i in (0, 4, 8)]
    assert torch.equal(whole, torch.cat(parts, dim=2))  # 12 rows each


@pytest.mark.parametrize("queries", [40, 200])
def test_a_prefill_block_reads_the_coordinates_by_bfloat16_products_as_decoded_chunks_read_them(monkeypatch, queries):
    # Where the kernel multiplies bfloat16, a block of many queries (a prefill chunk) reads the coordinates
    # themselves, as many queries a call as the kernel's rows allow (200 queries, 3 rows each per K/V head: two
    # calls), and its own K/V by the flash kernel: the values of decoding the keys a chunk at a time, within bfloat16
    # rounding, a slot no query reads and the causal block included.
    _require_kernel()
    kernel = held_kernel.held_kernel()
    assert kernel is not None
    if not kernel.bf16_products:
        pytest.skip("this CPU does not multiply bfloat16: a prefill block decodes chunks for the flash kernel")
    rng = np.random.default_rng(queries)
    groups, dim, history = 3, 64, 700
    q = torch.from_numpy(rng.standard_normal((1, KV_HEADS * groups, queries, dim)).astype(np.float32))
    keys, values = (torch.from_numpy(rng.standard_normal((1, KV_HEADS, history, dim)).astype(np.float32)) for _ in "kv")
    own = tuple(torch.from_numpy(rng.standard_normal((1, KV_HEADS, queries, dim)).astype(np.float32)) for _ in "kv")
    held = _held(TorchLatticeCodec(LatticeSpec("d4", dim, 38), torch.device("cpu")), keys, values)
    allowed = np.ones((queries, history + queries), dtype=bool)
    allowed[:, 3] = False
    allowed[:, history:] = np.tril(np.ones((queries, queries), dtype=bool))
    mask = torch.from_numpy(allowed)
    assert queries >= held_attention.DECODED_QUERIES
    assert held_kernel.reads_blocks(q, held.coding.doubled, KV_HEADS)
    by_rows = attend_parts(q, [held, own], mask, scale=dim**-0.5)
    monkeypatch.setattr(held_kernel, "reads_blocks", lambda *args: False)
    decoded = attend_parts(q, [held, own], mask, scale=dim**-0.5)
    np.testing.assert_allclose(by_rows.numpy(), decoded.numpy(), atol=2e-3, rtol=2e-2)
    decoded_keys, decoded_values = held.dense()
    everything = (torch.cat([decoded_keys, own[0]], 2), torch.cat([decoded_values, own[1]], 2))
    expected = _reference(q.numpy(), everything[0].numpy(), everything[1].numpy(), allowed, dim**-0.5)
    np.testing.assert_allclose(by_rows.numpy(), expected, atol=2e-3, rtol=2e-2)


def test_the_kernel_is_built_once_per_source_compiler_and_cpu_and_can_be_turned_off(monkeypatch, tmp_path, caplog):
    _require_kernel()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    held_kernel.held_kernel.cache_clear()
    try:
        built = held_kernel.held_kernel()
        assert built is not None and built.library.parent == tmp_path / "kakeya" / "kernels"
        modified = built.library.stat().st_mtime_ns
        held_kernel.held_kernel.cache_clear()
        again = held_kernel.held_kernel()
        assert again is not None and again.library == built.library
        assert built.library.stat().st_mtime_ns == modified  # loaded from the cache, not compiled again
        monkeypatch.setenv(held_kernel.ENV, "off")
        held_kernel.held_kernel.cache_clear()
        with caplog.at_level("INFO", logger=held_kernel.__name__):
            assert held_kernel.held_kernel() is None
        assert "TorchScript ops (KAKEYA_HELD_KERNEL=off)" in caplog.text
    finally:
        held_kernel.held_kernel.cache_clear()


def test_a_compiler_that_fails_leaves_the_scripted_path_and_says_why(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    use_broken_compiler(monkeypatch, tmp_path, "no such target")
    held_kernel.held_kernel.cache_clear()
    try:
        with caplog.at_level("WARNING", logger=held_kernel.__name__):
            assert held_kernel.held_kernel() is None
        assert "the compiled kernel is unavailable" in caplog.text and "no such target" in caplog.text
        assert not list((tmp_path / "kakeya" / "kernels").glob("*.so"))  # nothing half-built is left to load
    finally:
        held_kernel.held_kernel.cache_clear()


@pytest.mark.parametrize("dim", [8, 32, 64, 128])
@pytest.mark.parametrize("queries", [1, 9])
@pytest.mark.parametrize("unit", ["tiles", "vectors", "avx2"])
def test_the_kernel_reads_every_head_size_and_block_as_the_scripted_ops_do(monkeypatch, dim, queries, unit):
    # Head sizes 64 and 128 run code built for that size, 32 the general code, 8 no vector code (fewer than 16
    # values); a single query scores key by key, a block of nine (27 rows) a transposed tile at a time. On the tile
    # unit (head sizes that are multiples of 32, 8 rows or more), the rotated queries and the weights are rounded to
    # bfloat16, and so on the vectors of a CPU with AVX512-BF16 (the weights where the head size is a multiple of
    # 64). `avx2`: on a CPU with AVX-512, the kernel built without it (its 256-bit path).
    _require_kernel()
    kernel = held_kernel.held_kernel()
    assert kernel is not None
    if unit == "tiles" and not kernel.tiles:
        pytest.skip("this CPU has no tile unit (AMX) the kernel can use; its vector path is tested instead")
    if unit == "vectors":
        vectors = dataclasses.replace(kernel, tiles=False)
        monkeypatch.setattr(held_kernel, "held_kernel", lambda: vectors)
    if unit == "avx2":
        if kernel.vector_bits != 512:
            pytest.skip(f"the kernel's own build runs {kernel.vector_bits}-bit vectors here (tested as `vectors`)")
        narrower = kernel_without_avx512()
        assert narrower.vector_bits == 256 and not narrower.tiles
        monkeypatch.setattr(held_kernel, "held_kernel", lambda: narrower)
    rng = np.random.default_rng(dim + queries)
    q = torch.from_numpy(rng.standard_normal((1, 9, queries, dim)).astype(np.float32))
    keys, values = (torch.from_numpy(rng.standard_normal((1, 3, 700, dim)).astype(np.float32)) for _ in "kv")
    own = tuple(torch.from_numpy(rng.standard_normal((1, 3, queries, dim)).astype(np.float32)) for _ in "kv")
    held = _held(TorchLatticeCodec(LatticeSpec("d4", dim, 38), torch.device("cpu")), keys, values)
    allowed = np.ones((queries, 700 + queries), dtype=bool)
    allowed[:, 700:] = np.tril(np.ones((queries, queries), dtype=bool))
    mask = torch.from_numpy(allowed)
    compiled = attend_parts(q, [held, own], mask, scale=dim**-0.5)
    monkeypatch.setattr(held_kernel, "serves", lambda *args: False)
    scripted = attend_parts(q, [held, own], mask, scale=dim**-0.5)
    rounds = unit == "tiles" or (unit == "vectors" and kernel.bf16_products)
    tolerance = (2e-3, 2e-2) if rounds and dim % 32 == 0 and queries == 9 else (3e-5, 3e-5)
    np.testing.assert_allclose(compiled.numpy(), scripted.numpy(), atol=tolerance[0], rtol=tolerance[1])
