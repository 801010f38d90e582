"""The blocked key layout: every key at a place set by its position alone, in position order, with the keys of
each part (a restored prefix, a ring of slots and a stage) copied to their places once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kv_cache_proposer.backends.torch_backend.arrays import TorchArrayOps
from kv_cache_proposer.cache.key_layout import BlockedLayout

BLOCK = 8


def _ring(sink: int, window: int, end: int) -> np.ndarray:
    """The slot positions of a sink + window ring after `end` committed positions (−1: an empty slot)."""
    slots = np.full(sink + window, -1, dtype=np.int64)
    for position in range(end):
        slots[position if position < sink else sink + (position - sink) % window] = position
    return slots


def _kv(positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys holding their position and values holding minus it, `[1, 2, n, 3]`."""
    keys = torch.from_numpy(positions.astype(np.float32))[None, None, :, None].expand(1, 2, -1, 3).contiguous()
    return keys, -keys


def test_keys_sit_in_position_order_at_places_their_positions_set():
    ring, stage = _ring(2, 11, 30), np.arange(30, 33)
    layout = BlockedLayout([np.concatenate([ring, stage])], BLOCK)
    present = layout.positions[layout.positions >= 0]
    assert present.tolist() == [0, 1, *range(19, 33)]  # the sink, the window, the stage
    assert layout.positions.size % BLOCK == 0
    places = {int(p): i for i, p in enumerate(layout.positions) if p >= 0}
    assert all(place % BLOCK == position % BLOCK for position, place in places.items())
    # blocks no key falls in take no room: the sink's block, then those of positions 16-23, 24-31 and 32-39
    assert layout.positions.size == 4 * BLOCK


def test_a_position_s_block_holds_the_same_positions_however_the_block_around_it_was_cut():
    # Position 29 read by a one-token step, and by a block of 6 that starts at 25 (the ring then holds older keys)
    step = BlockedLayout([np.concatenate([_ring(2, 11, 29), [29]])], BLOCK)
    block = BlockedLayout([np.concatenate([_ring(2, 11, 25), np.arange(25, 31)])], BLOCK)
    for layout in (step, block):
        place = int(np.flatnonzero(layout.positions == 29)[0])
        start = place - place % BLOCK
        assert place % BLOCK == 29 % BLOCK
        held = layout.positions[start : start + BLOCK]
        assert set(held[held >= 0].tolist()) >= set(range(24, 30))  # every key of 29's block 29 may read


def test_gather_copies_every_part_s_keys_to_their_places_and_zeros_elsewhere():
    ops = TorchArrayOps(torch.device("cpu"))
    prefix = np.arange(2, 19)  # restored positions, in order: copied without a gather of their own
    slots = np.concatenate([_ring(2, 11, 30), np.arange(30, 33), [-1, -1]])  # with two empty slots
    layout = BlockedLayout([prefix, slots], BLOCK)
    assert layout.positions[:33].tolist() == list(range(33))
    keys, values = layout.gather(ops, [_kv(prefix), _kv(slots)])
    expected = np.where(layout.positions >= 0, layout.positions, 0).astype(np.float32)
    assert keys.shape == (1, 2, layout.positions.size, 3)
    np.testing.assert_array_equal(keys[0, 1, :, 2].numpy(), expected)
    np.testing.assert_array_equal(values[0, 0, :, 0].numpy(), -expected)


def test_an_empty_call_lays_out_nothing():
    layout = BlockedLayout([np.full(4, -1, dtype=np.int64)], BLOCK)
    assert layout.positions.size == 0


def test_a_position_read_twice_is_refused():
    with pytest.raises(ValueError, match="twice"):
        BlockedLayout([np.array([0, 1, 2]), np.array([2, 3])], BLOCK)
