"""Per-session K/V storage for the PyTorch backend.

Each layer holds one buffer `[1, kv_heads, capacity, head_dim]` whose slots are addressed by the strategy
(`slot_of(position)`), plus a staging area for the block of the forward in flight. `slot_positions[s]` is the
global position stored in slot s (-1: empty). Attention reads the slots and the stage together and the mask is
built from their positions, so the physical slot order never matters.

- `full`: slot = position and the stage sits right after the committed slots, so a commit moves nothing.
- `sink_window`: slots `[0, sink)` hold the sink, `[sink, sink + window)` are a ring for the window and the stage
  sits after the ring; a commit copies the accepted staged entries into their ring slots, overwriting evicted ones.
Either way, staged K/V of rejected drafts never overwrite a resident entry.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kv_cache_proposer.backends.slots import PositionBookkeeping, check_resident, commit_targets
from kv_cache_proposer.errors import InvariantViolation
from kv_cache_proposer.strategies import KVStrategy

_GROWTH_TOKENS = 256


class TorchSessionCache(PositionBookkeeping):
    """K/V buffers of one session, shared by every layer's slot table."""

    def __init__(self, strategy: KVStrategy, *, num_layers: int, device: torch.device) -> None:
        self._strategy = strategy
        self._num_layers = num_layers
        self._device = device
        self._next_position = 0
        self._keys: list[torch.Tensor | None] = [None] * num_layers
        self._values: list[torch.Tensor | None] = [None] * num_layers
        self._held: list[int] = [0] * num_layers  # resident entries per layer
        self._capacity = 0
        self._slot_positions = torch.full((0,), -1, dtype=torch.long, device=device)
        self._stage_positions = torch.empty(0, dtype=torch.long, device=device)
        self._staged_layers = [False] * num_layers
        self._block_start = 0  # index in the stage of the block of the forward in flight
        self._released = False

    # -- SessionCache ------------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        total = self._slot_positions.numel() * self._slot_positions.element_size()
        for tensor in (*self._keys, *self._values):
            if tensor is not None:
                total += tensor.numel() * tensor.element_size()
        return total

    @property
    def compressed_bytes(self) -> int:
        return 0

    def release(self) -> None:
        self._keys = [None] * self._num_layers
        self._values = [None] * self._num_layers
        self._slot_positions = torch.full((0,), -1, dtype=torch.long, device=self._device)
        self._released = True

    def clone(self, length: int) -> TorchSessionCache:
        """An independent cache holding this cache's positions [0, length) as if only they had been committed.

        Every position the strategy keeps resident at `length` must still be resident here (a bounded cache may
        have evicted some); raises ValueError otherwise.
        """
        if self._released or not 0 <= length <= self._next_position:
            raise ValueError(f"cannot clone {length} positions of a cache holding {self._next_position}")
        twin = TorchSessionCache(self._strategy, num_layers=self._num_layers, device=self._device)
        if length == 0:
            return twin
        slots, positions = commit_targets(self._strategy, 0, length)  # the resident set at `length`
        slot_idx = torch.tensor(slots, dtype=torch.long, device=self._device)
        wanted = torch.tensor(positions, dtype=torch.long, device=self._device)
        if not bool((self._slot_positions[slot_idx] == wanted).all()):
            raise ValueError(f"positions below {length} were evicted; they cannot be cloned")
        capacity = max(slots) + 1
        twin._grow(capacity)
        for source, target in ((self._keys, twin._keys), (self._values, twin._values)):
            for i, buf in enumerate(source):
                if buf is not None:
                    copy = torch.zeros((*buf.shape[:2], capacity, buf.shape[3]), dtype=buf.dtype, device=buf.device)
                    copy[:, :, slot_idx] = buf.index_select(2, slot_idx)  # [1, H, capacity, D]
                    target[i] = copy
        twin._slot_positions[slot_idx] = wanted
        twin._held = [len(slots) if key is not None else 0 for key in twin._keys]
        twin._next_position = length
        twin.check_invariants()
        return twin

    # -- staging -----------------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self._num_layers

    @property
    def stage_offset(self) -> int:
        """First slot of the stage; slots before it are read by attention together with the stage."""
        bounded = self._strategy.bounded_slots
        return self._next_position if bounded is None else bounded

    @property
    def keys_before_block(self) -> int:
        """Key slots attention reads ahead of the block in flight: resident slots and earlier staged blocks."""
        return self.stage_offset + self._block_start

    def begin_stage(self, block_len: int, *, extend: bool = False) -> torch.Tensor:
        """Reserve room for a block at the next positions; returns the key positions attention will read [K].

        With `extend` the block goes after what the previous forward staged (and sees it); otherwise the
        previous stage is dropped.
        """
        if self._released:
            raise RuntimeError("the cache was released")
        kept = self._stage_positions.numel() if extend else 0
        needed = self.stage_offset + kept + block_len
        if needed > self._capacity:
            if self._strategy.bounded_slots is None:
                # Unbounded caches grow geometrically so appends stay amortised O(1).
                needed = max(needed, self._capacity + max(self._capacity // 2, _GROWTH_TOKENS))
            self._grow(needed)
        start = self._next_position + kept
        block = torch.arange(start, start + block_len, dtype=torch.long, device=self._device)
        self._stage_positions = torch.cat([self._stage_positions[:kept], block])
        self._block_start = kept
        self._staged_layers = [False] * self._num_layers
        offset = self.stage_offset
        return torch.cat([self._slot_positions[:offset], self._stage_positions])

    def stage_layer(
        self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a layer's block K/V `[1, H, n, D]` into its stage; return the K/V attention reads `[1, H, K, D]`."""
        block_len = keys.shape[-2]
        expected = self._stage_positions.numel() - self._block_start
        if block_len != expected:
            raise InvariantViolation("inv1", f"layer {layer_idx} staged {block_len} K/V for a block of {expected}")
        if self._keys[layer_idx] is None:
            shape = (keys.shape[0], keys.shape[1], self._capacity, keys.shape[3])
            self._keys[layer_idx] = torch.zeros(shape, dtype=keys.dtype, device=keys.device)
            self._values[layer_idx] = torch.zeros(
                (*shape[:-1], values.shape[3]), dtype=values.dtype, device=values.device
            )
        key_buf, value_buf = self._keys[layer_idx], self._values[layer_idx]
        assert key_buf is not None and value_buf is not None
        begin = self.stage_offset + self._block_start
        end = begin + block_len
        key_buf[:, :, begin:end] = keys
        value_buf[:, :, begin:end] = values
        self._staged_layers[layer_idx] = True
        return key_buf[:, :, :end], value_buf[:, :, :end]

    def commit(self, count: int) -> None:
        """Make the first `count` staged positions resident and drop the rest of the stage."""
        staged = self._stage_positions.numel()
        if not 0 <= count <= staged:
            raise ValueError(f"cannot commit {count} of {staged} staged positions")
        if count and not all(self._staged_layers):
            missing = [i for i, done in enumerate(self._staged_layers) if not done]
            raise InvariantViolation("inv1", f"layers {missing} received no K/V in the last forward")
        offset = self.stage_offset
        start = self._next_position
        if self._strategy.bounded_slots is None:
            self._slot_positions[offset : offset + count] = self._stage_positions[:count]
            newly_held = count
        else:
            slots, sources = commit_targets(self._strategy, start, count)
            before = int((self._slot_positions[slots] >= 0).sum()) if slots else 0
            if slots:
                slot_idx = torch.tensor(slots, dtype=torch.long, device=self._device)
                src_idx = torch.tensor(sources, dtype=torch.long, device=self._device) + offset
                for buf in (*self._keys, *self._values):
                    if buf is not None:
                        buf.index_copy_(2, slot_idx, buf.index_select(2, src_idx))
                self._slot_positions[slot_idx] = src_idx - offset + start
            newly_held = len(slots) - before
        for layer_idx in range(self._num_layers):
            if self._keys[layer_idx] is not None:
                self._held[layer_idx] += newly_held
        self._next_position = start + count
        self._stage_positions = self._stage_positions[:0]
        self._block_start = 0
        self.check_invariants()

    def check_invariants(self) -> None:
        """INV-1: every layer holds exactly the strategy's resident count, as does the slot table."""
        held = [count if self._keys[i] is not None else None for i, count in enumerate(self._held)]
        check_resident(held, int((self._slot_positions >= 0).sum()), self.resident_count)

    def _grow(self, capacity: int) -> None:
        positions = torch.full((capacity,), -1, dtype=torch.long, device=self._device)
        positions[: self._capacity] = self._slot_positions
        self._slot_positions = positions
        for buffers in (self._keys, self._values):
            for i, old in enumerate(buffers):
                if old is None:
                    continue
                new = torch.zeros((*old.shape[:2], capacity, old.shape[3]), dtype=old.dtype, device=old.device)
                new[:, :, : self._capacity] = old
                buffers[i] = new
        self._capacity = capacity

    # -- inspection --------------------------------------------------------------------------------------------
    def resident_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Resident (keys, values, positions) of one layer, ordered by position: `[1, H, R, D]` x2 and `[R]`."""
        keys, values = self._keys[layer_idx], self._values[layer_idx]
        if keys is None or values is None:
            raise ValueError(f"layer {layer_idx} holds no K/V")
        positions = self._slot_positions[: self._capacity]
        slots = torch.nonzero(positions >= 0).flatten()
        order = torch.argsort(positions[slots])
        slots = slots[order]
        return keys.index_select(2, slots), values.index_select(2, slots), positions[slots]


class _StagingLayer(CacheLayerMixin):
    """transformers cache layer that writes a forward's K/V into a session cache's stage."""

    is_sliding = False

    def __init__(self, cache: TorchSessionCache, layer_idx: int) -> None:
        super().__init__()
        self._cache = cache
        self._layer_idx = layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._cache.stage_layer(self._layer_idx, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.keys_before_block + query_length, 0

    def get_seq_length(self) -> int:
        return self._cache.keys_before_block

    def get_max_length(self) -> int:
        return -1


class StagingCache(Cache):
    """The `past_key_values` object of one forward: routes every layer's update into the session's stage."""

    def __init__(self, cache: TorchSessionCache) -> None:
        super().__init__(layers=[_StagingLayer(cache, i) for i in range(cache.num_layers)])
