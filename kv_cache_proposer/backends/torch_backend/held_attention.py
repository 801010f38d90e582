"""Attention over K/V held as lattice coordinates (`TorchHeldKeys`, what `TorchLatticeCodec.held_keys` gives): a
decode step or a speculative block reads the coordinates themselves, chunk by chunk in the rotated space; so does a
block of many queries (a prefill chunk) where the compiled kernel multiplies bfloat16, a block of rows at a time;
elsewhere such a block decodes a chunk of keys at a time and reads it with the CPU flash kernel."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import cache
from typing import Any, Optional

import torch

from kv_cache_proposer.backends.torch_backend import held_kernel
from kv_cache_proposer.backends.torch_backend.chunked_attention import Partial, flash_partial, merge
from kv_cache_proposer.compression.codec import StagedCoding

HELD_CHUNK = 4096
"""Held keys that attention converts to float32 at once, at most: large enough that per-chunk work costs little (a
decode step over 8k held keys of the default model: 4,096 ran fastest of 1,024 to 8,192)."""

HELD_SCORES = 1 << 21
"""Scores (query rows × keys) of one chunk, at most: a block of many queries (a prefill chunk) reads fewer keys per
chunk, so a chunk's float32 scores stay within 8 MB whatever the block."""

HELD_PARALLEL = 3 << 17
"""Coordinates one chunk converts to float32 (batch × K/V heads × keys × head dim), from which a block's held
attention runs on every thread. Below it, on one: its thirty-odd small ops are each a parallel region whose workers
are woken from sleep between a forward's other ops (the bundled model, one K/V head: a decode step over 2k / 8k held
keys took half the time on one thread). From it on the ops are large enough to pay the workers: the default
model's three K/V heads over 2k to 8k keys attend in 0.58-0.70× the time on both threads of a 2-core machine, and
its compressed sessions decode 1.3× faster at 8k tokens through the daemon (docs/benchmarks.md)."""

DECODED_QUERIES = 32
"""Queries of a block from which held keys are decoded a chunk at a time and attended by matrix products on every
thread (`TorchHeldKeys._attend_decoded`): a prefill chunk. A decode step or a speculative block attends the
coordinates themselves, whose few ops per chunk cost less than decoding for a handful of queries; so does a prefill
chunk where the compiled kernel multiplies bfloat16 (`held_kernel.reads_blocks`), whose products there take half
the time of float32 ones (a 512-query chunk over 4,096 held keys of the default model: 19 ms a layer against 33 ms
decoded for the flash kernel, on a 2-core AMD EPYC with AVX512-BF16; in float32 the two took the same time)."""

DECODED_CHUNK = 2048
"""Held keys decoded at once for a block of many queries: the dense K/V that exist at a time."""


def _held_attention(
    q: torch.Tensor,
    doubled: torch.Tensor,
    norms: torch.Tensor,
    qmax: torch.Tensor,
    tail_keys: torch.Tensor,
    tail_values: torch.Tensor,
    held_allowed: Optional[torch.Tensor],  # noqa: UP045 (TorchScript reads `Optional`)
    tail_allowed: Optional[torch.Tensor],  # noqa: UP045
    hadamard: torch.Tensor,
    scale: float,
    q_range: int,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the queries `q` `[B, H, n, D]` over held keys (doubled coordinates `[2B, H_kv, c, D]`, K rows
    then V rows, and their fp16 norms and qmax `[2B, H_kv, c, 1]`) followed by dense `tail` K/V `[B, H_kv, t, D]`
    (`held_allowed` `[n, c]` and `tail_allowed` `[n, t]`, None: every one of those keys), as a `Partial`: output
    `[B, H_kv, g·n, D]` and log-sum-exp.

    A softmax kept online over chunks of `chunk` held keys, then the tail: a chunk's coordinates are converted to
    float32, scored against the rotated queries and scaled by their s·n/2 (see `TorchHeldKeys`)."""
    batch, heads, n, dim = q.shape
    kv_heads, count = doubled.shape[1], doubled.shape[2]
    groups = heads // kv_heads
    grouped = q.reshape(batch, kv_heads, groups * n, dim).float()
    rotated = torch.matmul(grouped, hadamard.t()) * scale
    factors = (qmax.float() * norms.float() * (0.5 / q_range)).transpose(-1, -2)  # [2B, H_kv, 1, c]
    held_rows: Optional[torch.Tensor] = None  # noqa: UP045
    if held_allowed is not None:
        held_rows = ~held_allowed.repeat(groups, 1)  # [g·n, c]: the keys each query head's rows may not read
    top = torch.full((batch, kv_heads, groups * n, 1), float("-inf"), device=q.device)
    sums = torch.zeros_like(top)
    held = torch.zeros_like(grouped)  # in the rotated space
    start = 0
    while start < count:
        end = min(count, start + chunk)
        keys = doubled[:batch, :, start:end].float()
        scores = torch.matmul(rotated, keys.transpose(-1, -2)).mul_(factors[:batch, :, :, start:end])
        if held_rows is not None:
            scores = scores.masked_fill_(held_rows[:, start:end], float("-inf"))
        new_top = torch.maximum(top, scores.amax(dim=-1, keepdim=True))
        safe = torch.where(torch.isinf(new_top), torch.zeros_like(new_top), new_top)
        weights = scores.sub_(safe).exp_()  # in place: a chunk's scores are its largest buffer
        correction = torch.exp(top - safe)
        sums = sums * correction + weights.sum(dim=-1, keepdim=True)
        values = doubled[batch:, :, start:end].float()
        held = held * correction + torch.matmul(weights.mul_(factors[batch:, :, :, start:end]), values)
        top = new_top
        start = end
    out = torch.matmul(held, hadamard)
    if tail_keys.shape[2] > 0:
        scores = torch.matmul(grouped, tail_keys.float().transpose(-1, -2)) * scale
        if tail_allowed is not None:
            scores = scores.masked_fill(~tail_allowed.repeat(groups, 1), float("-inf"))
        new_top = torch.maximum(top, scores.amax(dim=-1, keepdim=True))
        safe = torch.where(torch.isinf(new_top), torch.zeros_like(new_top), new_top)
        weights = torch.exp(scores - safe)
        correction = torch.exp(top - safe)
        sums = sums * correction + weights.sum(dim=-1, keepdim=True)
        out = out * correction + torch.matmul(weights, tail_values.float())
        top = new_top
    safe = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    return out / sums.clamp_min(1.1754943508222875e-38), safe + torch.log(sums)


@cache
def _compiled_attention() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.script(_held_attention)


class TorchHeldKeys:
    """K/V held as lattice coordinates (`StagedCoding`: K rows, then V rows), attended without decoding them.

    A decoded key is `(c·s) H · n` (coordinates c, scale s = qmax/Q, norm n, the self-inverse rotation H), so a
    query's score is `(q Hᵀ)·c · s·n` and the weighted values are `(Σ w·s·n·c) H`: attention runs on the
    coordinates in the rotated space, chunk by chunk, and rotates each query's output back once. Float32
    throughout; the scores equal those over the decoded keys within float rounding, not bit for bit. Compiled
    with TorchScript, as the codec's steps are: a decode step pays per op it dispatches."""

    def __init__(
        self,
        coding: StagedCoding[torch.Tensor],
        hadamard: torch.Tensor,
        q_range: int,
        dtype: torch.dtype,
        decoded: Callable[..., torch.Tensor],
    ):
        """`decoded`: the codec's compiled decode step `(lattice, scale, norms, hadamard) -> vectors`."""
        self.coding = coding
        self._hadamard = hadamard
        self._q_range = q_range
        self._dtype = dtype
        self._decoded = decoded

    @property
    def length(self) -> int:
        return int(self.coding.doubled.shape[2])

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._dense(self.coding, self._dtype)

    def _dense(self, coding: StagedCoding[torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """What `coding` decodes to, as keys and values in `dtype`."""
        doubled, norms, qmax = coding.doubled, coding.norms, coding.qmax
        shape = doubled.shape
        lattice = doubled.reshape(-1, shape[-1]).to(torch.float32) / 2  # exact: halves of integers
        scale = qmax.reshape(-1, 1).to(torch.float32) / float(self._q_range)
        decoded = self._decoded(lattice, scale, norms.reshape(-1, 1), self._hadamard).reshape(shape).to(dtype)
        batch = shape[0] // 2
        return decoded[:batch], decoded[batch:]

    def attend(
        self,
        q: torch.Tensor,
        allowed: torch.Tensor | None,
        scale: float,
        tail: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Partial:
        """Attention of the queries `[B, H, n, D]` over these keys and then the dense `tail` K/V, if any
        (`allowed` `[n, length + tail]`, None: all)."""
        doubled = self.coding.doubled
        if int(q.shape[2]) >= DECODED_QUERIES:
            if self.length and held_kernel.reads_blocks(q, doubled, int(doubled.shape[1])):
                return self._attend_rows(q, allowed, scale, tail)
            return self._attend_decoded(q, allowed, scale, tail)
        if tail is None:
            empty = doubled.new_zeros((doubled.shape[0] // 2, doubled.shape[1], 0, doubled.shape[3]), dtype=q.dtype)
            tail = (empty, empty)
        threads = torch.get_num_threads()
        if self.length and held_kernel.serves(q, doubled, int(doubled.shape[1])):
            kernel = held_kernel.held_kernel()
            assert kernel is not None
            count = self.length
            held_allowed = None if allowed is None else _unless_all(allowed[:, :count])
            tail_allowed = None if allowed is None else allowed[:, count:]
            return kernel.attend(
                q, self.coding, held_allowed, tail, tail_allowed, self._hadamard, scale, self._q_range, threads
            )
        converted = int(doubled.shape[0]) // 2 * int(doubled.shape[1]) * min(self.length, self._chunk(q))
        if q.device.type == "cpu" and threads > 1 and converted * int(doubled.shape[3]) < HELD_PARALLEL:
            torch.set_num_threads(1)  # small ops: see HELD_PARALLEL
            try:
                return self._attend(q, allowed, scale, tail)
            finally:
                torch.set_num_threads(threads)
        return self._attend(q, allowed, scale, tail)

    @staticmethod
    def _chunk(q: torch.Tensor) -> int:
        """Held keys one chunk of `_held_attention` converts for the queries `q`."""
        return max(1, min(HELD_CHUNK, HELD_SCORES // (int(q.shape[0]) * int(q.shape[1]) * int(q.shape[2]))))

    def _attend_rows(
        self,
        q: torch.Tensor,
        allowed: torch.Tensor | None,
        scale: float,
        tail: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> Partial:
        """Attention of a block of many queries by the compiled kernel over the coordinates, as many queries a call
        as its rows allow, and the tail by the CPU flash kernel, merged by their log-sum-exps."""
        kernel = held_kernel.held_kernel()
        assert kernel is not None
        doubled = self.coding.doubled
        batch, heads, n, dim = (int(s) for s in q.shape)
        kv_heads, count = int(doubled.shape[1]), self.length
        groups = heads // kv_heads
        step = held_kernel.MAX_ROWS // groups
        empty = doubled.new_zeros((batch, kv_heads, 0, dim), dtype=q.dtype)
        threads = torch.get_num_threads()
        outs, lses = [], []
        for start in range(0, n, step):
            end = min(n, start + step)
            columns = None if allowed is None else _unless_all(allowed[start:end, :count])
            out, lse = kernel.attend(
                q[:, :, start:end],
                self.coding,
                columns,
                (empty, empty),
                None,
                self._hadamard,
                scale,
                self._q_range,
                threads,
            )
            # rows of a call: query head within the group, then query; the calls' queries joined per group
            outs.append(out.reshape(batch, kv_heads, groups, end - start, dim))
            lses.append(lse.reshape(batch, kv_heads, groups, end - start, 1))
        merged: Partial = (
            torch.cat(outs, 3).reshape(batch, kv_heads, groups * n, dim),
            torch.cat(lses, 3).reshape(batch, kv_heads, groups * n, 1),
        )
        return _with_tail(merged, q, allowed, count, scale, tail)

    def _attend_decoded(
        self,
        q: torch.Tensor,
        allowed: torch.Tensor | None,
        scale: float,
        tail: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> Partial:
        """Attention of a block of many queries: `DECODED_CHUNK` keys at a time decoded into dense K/V and attended
        by the CPU flash kernel (matrix products off the CPU), the chunks and the tail merged by their
        log-sum-exps (within float rounding of attending the coordinates)."""
        merged: Partial | None = None
        count = self.length
        for start in range(0, count, DECODED_CHUNK):
            end = min(count, start + DECODED_CHUNK)
            chunk = StagedCoding(*(array[:, :, start:end] for array in self.coding.arrays()))
            keys, values = self._dense(chunk, torch.float32)
            columns = None if allowed is None else _unless_all(allowed[:, start:end])
            merged = merge(merged, flash_partial(q, keys, values, columns, scale=scale))
        return _with_tail(merged, q, allowed, count, scale, tail)

    def _attend(
        self, q: torch.Tensor, allowed: torch.Tensor | None, scale: float, tail: tuple[torch.Tensor, torch.Tensor]
    ) -> Partial:
        doubled = self.coding.doubled
        count = self.length
        held_allowed = None if allowed is None else _unless_all(allowed[:, :count])
        tail_allowed = None if allowed is None else allowed[:, count:]
        return _compiled_attention()(
            q,
            doubled,
            self.coding.norms,
            self.coding.qmax,
            tail[0],
            tail[1],
            held_allowed,
            tail_allowed,
            self._hadamard,
            scale,
            self._q_range,
            self._chunk(q),
        )


def _with_tail(
    merged: Partial | None,
    q: torch.Tensor,
    allowed: torch.Tensor | None,
    count: int,
    scale: float,
    tail: tuple[torch.Tensor, torch.Tensor] | None,
) -> Partial:
    """`merged` (the queries' attention over `count` held keys, None: none read) with the dense `tail` after them
    read by the CPU flash kernel (`allowed` `[n, count + t]`, None: all), merged by their log-sum-exps."""
    if tail is not None and tail[0].shape[2] > 0:
        columns = None if allowed is None else allowed[:, count:]
        merged = merge(merged, flash_partial(q, tail[0], tail[1], columns, scale=scale))
    if merged is None:
        raise ValueError("attention needs at least one key")
    return merged


def _unless_all(columns: torch.Tensor) -> torch.Tensor | None:
    """`columns` (which keys each query may read), or None on the CPU when every query may read every one of them (a
    resident history, as a rule): no mask is then applied to their scores, the same values without a pass over
    every score. Elsewhere the check would wait for the device, so the mask stays."""
    return None if columns.device.type == "cpu" and bool(columns.all()) else columns
