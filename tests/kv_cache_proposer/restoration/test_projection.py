"""f_θ's host products: a position's restored row does not depend on the positions mapped beside it."""

from __future__ import annotations

import numpy as np
import pytest

from kv_cache_proposer.restoration import LinearProjection, Rotary
from kv_cache_proposer.restoration.drafter_context import DrafterContext

# However a history arrives, a forward evicts 1, 2, 3, ... positions at a time, and a rebuild all of them at once.
SPLITS = [[1] * 12, [2, 1, 3, 1, 5], [3, 9], [8, 4], [12]]


def _in_pieces(apply, rows: np.ndarray, positions: np.ndarray, sizes: list[int]) -> np.ndarray:
    out, start = [], 0
    for size in sizes:
        out.append(apply(rows[start : start + size], positions[start : start + size]))
        start += size
    return np.concatenate(out)


@pytest.mark.parametrize("frame", ["stored", "unrotated"])
def test_a_rows_projection_does_not_depend_on_the_rows_mapped_with_it(frame: str):
    rng = np.random.default_rng(5)
    width = 2 * 4 * 32  # K and V of 4 heads x 32: wide enough for the BLAS's blocked kernels
    rotary = Rotary(1.0 / 10_000 ** (np.arange(16) / 16)) if frame == "unrotated" else None
    f_theta = LinearProjection(
        rng.normal(size=(width, width)).astype(np.float32) * 0.1,
        rng.normal(size=width).astype(np.float32),
        rotary,
        reads_keys=rotary is not None,
    )
    rows = rng.normal(size=(12, width)).astype(np.float32)
    positions = np.arange(300, 312, dtype=np.int64)
    for sizes in SPLITS:
        np.testing.assert_array_equal(_in_pieces(f_theta.apply, rows, positions, sizes), f_theta.apply(rows, positions))


def test_a_drafter_context_row_does_not_depend_on_the_rows_computed_with_it():
    rng = np.random.default_rng(6)
    hidden, layers = 96, 2
    context = DrafterContext((1, 3), rng.normal(size=(hidden, layers * hidden)).astype(np.float32), np.ones(hidden))
    features = rng.normal(size=(12, layers * hidden)).astype(np.float32)
    positions = np.arange(12)
    for sizes in SPLITS:
        pieces = _in_pieces(lambda rows, _: context.apply(rows), features, positions, sizes)
        np.testing.assert_array_equal(pieces, context.apply(features))
