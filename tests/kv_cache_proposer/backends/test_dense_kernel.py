"""The compiled kernel's attention over dense K/V (`HeldKernel.attend_dense`, reached through `attend_exact` with
`KAKEYA_DENSE_ATTENTION=compiled`):
PyTorch's masked attention within float rounding for every head size, grouping, precision and mask; and a query's
values bit for bit the same whatever block it arrives in, however many queries a call takes, on any thread
count; each on the tile unit and on the vector units; and PyTorch's own use of the tile unit undisturbed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kv_cache_proposer.backends.torch_backend import exact_attention
from kv_cache_proposer.backends.torch_backend.chunked_attention import flash_cpu
from kv_cache_proposer.backends.torch_backend.direct import OVER_HISTORY

TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2e-2}


pytestmark = pytest.mark.usefixtures("compiled_attention")  # every test here runs the compiled kernel


def _inputs(dtype: torch.dtype, groups: int, n: int, count: int, dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(seed)
    q = torch.randn(1, n, 2 * groups, dim, dtype=dtype).transpose(1, 2)  # the layout the forward gives
    keys, values = (torch.randn(1, 2, count, dim, dtype=dtype) for _ in "kv")
    return q, keys, values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [8, 32, 64, 128])
@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize(("n", "count"), [(1, 1), (1, 700), (5, 1300), (200, 1030)])
@pytest.mark.parametrize("holes", [False, True], ids=["causal", "keys-no-query-reads"])
def test_the_kernel_attends_as_pytorch_s_masked_attention(dtype, dim, groups, n, count, holes):
    q, keys, values = _inputs(dtype, groups, n, count, dim, seed=dim + n)
    visible = torch.arange(count)[None, :] <= torch.arange(count - n, count)[:, None]
    if holes:
        visible[:, 1::7] = False
    mask = visible[None, None] if holes else OVER_HISTORY
    got = exact_attention.attend_exact(q, keys, values, mask, groups, dim**-0.5, {})
    expected = F.scaled_dot_product_attention(
        q.float(), keys.float(), values.float(), attn_mask=visible[None, None], scale=dim**-0.5, enable_gqa=True
    )
    assert got.dtype == dtype and got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [8, 64])
def test_a_query_s_values_are_the_same_bits_in_any_block_call_size_or_thread_count(monkeypatch, dtype, dim):
    groups, total = 3, 1400
    q, keys, values = _inputs(dtype, groups, total, total, dim, seed=dim)

    def delivered(sizes: list[int]) -> torch.Tensor:
        outputs, start = [], 0
        for size in sizes:
            end = start + size
            outputs.append(
                exact_attention.attend_exact(
                    q[:, :, start:end], keys[:, :, :end], values[:, :, :end], OVER_HISTORY, groups, 0.3, {}
                )
            )
            start = end
        return torch.cat(outputs, dim=2)

    expected = delivered([total])  # several calls of MAX_ROWS rows at most
    for sizes in ([1] * 30 + [1370], [512, 511, 1, 376], [3, 700, 697], [64] * 21 + [56]):
        assert torch.equal(delivered(sizes), expected), sizes
    monkeypatch.setattr(exact_attention, "DENSE_ROWS", 7)  # two queries a call
    assert torch.equal(delivered([5, 1395]), expected)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(delivered([total]), expected)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_attended_together_get_the_bits_each_gets_alone(dtype):
    """The rows of a batched forward in one call (`attend_exact_rows`): histories of different lengths (within one
    segment of the kernel and across several), one query or a block, under each kind of mask, float32 queries over
    K/V held at `dtype` as the forward hands them; each row's output is the one it gets alone."""
    groups, dim = 3, 64
    shapes = [(1, 37), (1, 1500), (1, 513), (4, 700), (9, 2100)]
    queries, rows, expected = [], [], []
    start = 0
    for index, (n, count) in enumerate(shapes):
        q, keys, values = _inputs(torch.float32, groups, n, count, dim, seed=10 + index)
        keys, values = keys.to(dtype), values.to(dtype)
        visible = torch.arange(count)[None, :] <= torch.arange(count - n, count)[:, None]
        visible[:, 3::11] = False
        mask = (visible[None, None], OVER_HISTORY, None)[index % 3] if n == 1 else visible[None, None]
        queries.append(q)
        rows.append((start, start + n, keys, values, mask))
        start += n
        alone = exact_attention.attend_exact(q.to(dtype), keys, values, mask, groups, 0.125, {})
        expected.append(alone.to(dtype).to(torch.float32))
    packed = torch.cat(queries, dim=2)

    def check(got: torch.Tensor | None) -> None:
        assert got is not None and got.dtype == torch.float32 and got.shape == packed.shape
        for (start, end, *_), wanted in zip(rows, expected, strict=True):
            assert torch.equal(got[:, :, start:end], wanted), (start, end)

    check(exact_attention.attend_exact_rows(packed, rows, groups, 0.125, {}))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        check(exact_attention.attend_exact_rows(packed, rows, groups, 0.125, {}))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(("n", "count"), [(1, 1), (1, 900), (5, 1300), (1400, 1400)])
def test_float32_queries_over_bfloat16_kv_get_the_values_of_the_casts_bit_for_bit(n, count):
    """The forward's float32 queries over K/V held at bfloat16: the values of the queries cast to bfloat16 and the
    output cast to bfloat16 and back (what `attend_exact` computes by casting, and where the kernel `rounds_queries`
    computes as it reads and writes), for one query, a block and a block attended in parts; queries on a rounding
    tie (between two bfloat16 values: to even) and a NaN-free output."""
    groups, dim = 3, 64
    q, keys, values = _inputs(torch.float32, groups, n, count, dim, seed=n + count)
    q[0, 0, 0, :4] = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(2.0 + 2.0**-7), 0.0])  # ties, and zero
    keys, values = keys.to(torch.bfloat16), values.to(torch.bfloat16)
    visible = torch.arange(count)[None, :] <= torch.arange(count - n, count)[:, None]
    for mask in (OVER_HISTORY, visible[None, None]):
        got = exact_attention.attend_exact(q, keys, values, mask, groups, 0.125, {})
        cast = exact_attention.attend_exact(q.to(torch.bfloat16), keys, values, mask, groups, 0.125, {})
        assert got.dtype == torch.float32 and cast.dtype == torch.bfloat16
        assert torch.equal(got, cast.float())
    kernel = exact_attention.dense_kernel()
    assert kernel is not None
    if kernel.rounds_queries:
        hi = torch.arange(count - n + 1, count + 1, dtype=torch.int64)
        with pytest.raises(ValueError, match="float32 queries over bfloat16"):
            kernel.attend_dense(q, keys.float(), values.float(), hi, None, 0.125, 1, rounded=True)


def test_keys_and_values_may_lie_apart_and_a_query_that_reads_nothing_gets_zeros():
    q, keys, _ = _inputs(torch.float32, 2, 3, 40, 16, seed=1)
    values = torch.randn(1, 40, 2, 16).transpose(1, 2)  # another layout than the keys'
    visible = torch.ones(3, 40, dtype=torch.bool)
    visible[1] = False
    got = exact_attention.attend_exact(q, keys, values, visible[None, None], 2, 0.25, {})
    assert torch.equal(got[:, :, 1], torch.zeros(1, 4, 16))
    for row in (0, 2):
        expected = F.scaled_dot_product_attention(
            q[:, :, row : row + 1], keys, values.contiguous(), scale=0.25, enable_gqa=True
        )
        torch.testing.assert_close(got[:, :, row : row + 1], expected, rtol=2e-6, atol=2e-6)


def test_pytorch_s_own_tile_unit_work_between_kernel_calls_is_undisturbed():
    """The kernel configures the tile unit on the threads it runs on and puts back what it found, so PyTorch's
    matrix products and flash attention (which keep their tile configuration between calls) still compute what
    they compute alone."""
    torch.manual_seed(3)
    a, b = torch.randn(96, 512, dtype=torch.bfloat16), torch.randn(512, 160, dtype=torch.bfloat16)
    q, keys, values = _inputs(torch.bfloat16, 3, 200, 1030, 64, seed=4)
    grouped = q.reshape(1, 2, 600, 64)

    def pytorch_s() -> tuple[torch.Tensor, torch.Tensor]:
        return a @ b, flash_cpu(grouped, keys, values, attn_mask=None, scale=0.125)[0]

    alone = pytorch_s()
    for _ in range(3):
        exact_attention.attend_exact(q, keys, values, OVER_HISTORY, 3, 0.125, {})
        between = pytorch_s()
        assert all(torch.equal(x, y) for x, y in zip(between, alone, strict=True))
