"""The backend-neutral session cache: replaceable layer stores, extra parts read ahead of the resident slots,
state round trips and clones, on every backend."""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import pytest

from kv_cache_proposer.cache import ArrayOps, CommitPlan, DenseLayerStore, KVSessionCache, StoreFootprint
from kv_cache_proposer.decoding import Decoder, GenerationBudget, SequenceState
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import FullStrategy, SinkWindowStrategy
from tests.support.backends import BACKENDS, to_numpy
from tests.support.checkpoints import COMMON_SHAPE, VOCAB_SIZE

pytestmark = pytest.mark.parametrize("backend", BACKENDS)

STRATEGIES = [FullStrategy(), SinkWindowStrategy(sink=2, window=10)]
STRATEGY_IDS = ["full", "sink"]


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_SIZE) for _ in range(n)]


def _greedy(verifier: Any, cache: Any, prompt: list[int], new_tokens: int) -> list[int]:
    seq = SequenceState(cache=cache, tokens=list(prompt))
    decoder = Decoder(verifier, prefill_chunk_tokens=7)
    budget = GenerationBudget(max_new_tokens=new_tokens)
    generated: list[int] = []
    while len(generated) < new_tokens:
        step = decoder.step(seq, SamplingParams(), budget, len(generated))
        generated += step.tokens
    return generated


class HalfPrecisionStore:
    """A layer store that holds every entry in float16 whatever the model's dtype, and hands attention the
    model's dtype back: a storage class written here alone, over the public array seam. It declares itself not
    lossy: every query reads its own position in float16 too, as it reads the others."""

    lossy = False

    def __init__(self, ops: ArrayOps[Any], *, half: Any) -> None:
        self._ops = ops
        self._dense: DenseLayerStore[Any] = DenseLayerStore(ops)
        self._model_dtype: Any = None
        self._half = half
        self.held = 0

    @property
    def active(self) -> bool:
        return self._dense.active

    @property
    def nbytes(self) -> int:
        return self._dense.nbytes

    def working_nbytes(self, slots: int) -> int:
        return self._dense.working_nbytes(slots)

    def load_from(self, source: Any, source_slots: np.ndarray, slots: np.ndarray) -> None:
        self.load(slots, *source.gather(source_slots))

    @classmethod
    def start_stages(cls, stores: Any) -> None:
        return None

    @classmethod
    def finish_stages(cls, stores: Any) -> None:
        return None

    def arrays(self) -> list[Any]:
        return self._dense.arrays()

    def reserve(self, capacity: int) -> None:
        self._dense.reserve(capacity)

    def _to_half(self, array: Any) -> Any:
        if self._model_dtype is None:
            self._model_dtype = self._ops.dtype(array)
        return self._ops.cast(array, self._half)

    def stage(self, slot: int, keys: Any, values: Any) -> None:
        self._dense.stage(slot, self._to_half(keys), self._to_half(values))

    def read(self, stage_offset: int, end: int) -> tuple[Any, Any]:
        keys, values = self._dense.read(stage_offset, end)
        return self._ops.cast(keys, self._model_dtype), self._ops.cast(values, self._model_dtype)

    def read_parts(self, stage_offset: int, end: int) -> list[Any]:
        return [self.read(stage_offset, end)]

    def commit(self, plan: CommitPlan) -> None:
        self._dense.commit(plan)
        self.held = self._dense.held

    def gather(self, slots: np.ndarray) -> tuple[Any, Any]:
        keys, values = self._dense.gather(slots)
        return self._ops.cast(keys, self._model_dtype), self._ops.cast(values, self._model_dtype)

    def load(self, slots: np.ndarray, keys: Any, values: Any) -> None:
        self._dense.load(slots, self._to_half(keys), self._to_half(values))

    def footprint(self) -> StoreFootprint:
        return self._dense.footprint()

    def park(self, slots: int) -> None:
        self._dense.park(slots)

    def release(self) -> None:
        self._dense.release()


def _float16(backend: str) -> Any:
    if backend == "torch":
        import torch

        return torch.float16
    import mlx.core as mx

    return mx.float16


@pytest.mark.parametrize("strategy", STRATEGIES, ids=STRATEGY_IDS)
def test_a_layer_store_defined_in_a_test_serves_a_session_with_the_dense_stores_greedy_tokens(
    verifiers, backend, strategy
):
    verifier = verifiers["qwen3"]
    prompt = _tokens(1, 30)
    dense = verifier.new_cache(strategy)
    half = verifier.new_cache(strategy, layer_store=partial(HalfPrecisionStore, half=_float16(backend)))
    assert _greedy(verifier, half, prompt, 24) == _greedy(verifier, dense, prompt, 24)
    # The session really ran on the half-precision store: it holds half the bytes of float32 K/V.
    positions = dense._slots.nbytes
    assert half.nbytes - positions == (dense.nbytes - positions) // 2


@dataclass(frozen=True, slots=True)
class WindowThatSeesEverything:
    """Resident like sink + window, but every query may read every earlier position: what a strategy that
    rebuilds evicted K/V in front of the resident ones needs."""

    resident: SinkWindowStrategy

    @property
    def name(self) -> str:
        return "test_sees_everything"

    @property
    def bounded_slots(self) -> int | None:
        return self.resident.bounded_slots

    def slot_of(self, position: int) -> int:
        return self.resident.slot_of(position)

    def slots_of(self, positions: np.ndarray) -> np.ndarray:
        return self.resident.slots_of(positions)

    def resident_count(self, committed: int) -> int:
        return self.resident.resident_count(committed)

    def resident_positions(self, committed: int) -> np.ndarray:
        return self.resident.resident_positions(committed)

    def visible(self, query_pos: Any, key_pos: Any) -> Any:
        return key_pos >= 0


class EvictedFromReference:
    """An attention prefix holding, for every evicted position, the K/V a full cache computed for it."""

    def __init__(self, reference: Any, positions: np.ndarray, ops: ArrayOps[Any]) -> None:
        self._positions = positions
        self._layers = []
        for layer in range(reference.num_layers):
            keys, values, held = reference.resident_kv(layer)
            index = np.searchsorted(held, positions)
            self._layers.append((ops.take(keys, index), ops.take(values, index)))

    @property
    def positions(self) -> np.ndarray:
        return self._positions

    def layer(self, layer_idx: int) -> tuple[Any, Any]:
        return self._layers[layer_idx]


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_evicted_kv_put_in_front_of_a_bounded_cache_give_full_attention(verifiers, arch):
    verifier = verifiers[arch]
    tokens = _tokens(2, 60)
    reference = verifier.new_cache(FullStrategy())
    full_logits = to_numpy(verifier.verify(reference, tokens, len(tokens)).logits)
    verifier.commit(reference, len(tokens))

    strategy = WindowThatSeesEverything(SinkWindowStrategy(sink=3, window=9))
    cache = verifier.new_cache(strategy)
    rows, start = [], 0
    for size in [12, 1, 1, 20, 5, 21]:
        committed = np.arange(cache.next_position)
        evicted = committed[~np.isin(committed, strategy.resident_positions(cache.next_position))]
        cache.attach_prefix(EvictedFromReference(reference, evicted, verifier.array_ops) if evicted.size else None)
        rows.append(to_numpy(verifier.verify(cache, tokens[start : start + size], size).logits))
        verifier.commit(cache, size)
        start += size
    assert cache.evicted_count == 60 - 12
    np.testing.assert_allclose(np.concatenate(rows), full_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=STRATEGY_IDS)
def test_a_cache_rebuilt_from_its_state_continues_exactly_like_the_original(verifiers, strategy):
    verifier = verifiers["llama"]
    prompt = _tokens(3, 33)
    original = verifier.new_cache(strategy)
    verifier.verify(original, prompt[:-1], 1)
    verifier.commit(original, len(prompt) - 1)
    rebuilt = KVSessionCache.from_state(original.state, original.meta_state, ops=verifier.array_ops)
    assert rebuilt.strategy == strategy and rebuilt.next_position == original.next_position
    assert rebuilt.resident_count == original.resident_count

    def continue_from(cache: Any) -> list[int]:
        seq = SequenceState(cache=cache, tokens=list(prompt), committed=len(prompt) - 1)
        decoder, budget = Decoder(verifier), GenerationBudget(max_new_tokens=12)
        generated: list[int] = []
        while len(generated) < 12:
            generated += decoder.step(seq, SamplingParams(), budget, len(generated)).tokens
        return generated

    assert continue_from(rebuilt) == continue_from(original)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=STRATEGY_IDS)
def test_a_clone_holds_what_a_cache_of_that_length_holds_and_is_independent(verifiers, strategy):
    verifier = verifiers["qwen3"]
    tokens = _tokens(4, 40)
    source = verifier.new_cache(strategy)
    verifier.verify(source, tokens[:30], 1)
    verifier.commit(source, 30)
    length = 30 if strategy.bounded_slots else 25
    clone = source.clone(length)
    fresh = verifier.new_cache(strategy)
    verifier.verify(fresh, tokens[:length], 1)
    verifier.commit(fresh, length)
    # Both continue with the same block: same logits, and the source is untouched by the clone's commits.
    expected = to_numpy(verifier.verify(fresh, tokens[length:40], 40 - length).logits)
    got = to_numpy(verifier.verify(clone, tokens[length:40], 40 - length).logits)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)
    verifier.commit(clone, 40 - length)
    assert source.next_position == 30 and clone.next_position == 40


def test_a_clone_refuses_a_length_whose_positions_were_evicted(verifiers):
    verifier = verifiers["qwen3"]
    cache = verifier.new_cache(SinkWindowStrategy(sink=2, window=6))
    verifier.verify(cache, _tokens(5, 20), 1)
    verifier.commit(cache, 20)
    with pytest.raises(ValueError, match="evicted"):
        cache.clone(12)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=STRATEGY_IDS)
def test_a_stage_extended_one_position_at_a_time_commits_like_one_block(verifiers, strategy):
    # A cache rebuilt from its state has never staged a block longer than one position before this.
    verifier = verifiers["llama"]
    prompt, more = _tokens(5, 30), _tokens(6, 4)
    original = verifier.new_cache(strategy)
    verifier.verify(original, prompt, 1)
    verifier.commit(original, len(prompt))
    caches = [KVSessionCache.from_state(original.state, original.meta_state, ops=verifier.array_ops) for _ in "ab"]
    verifier.verify(caches[0], more, 1)
    for i, token in enumerate(more):
        verifier.verify(caches[1], [token], 1, extend_stage=i > 0)
    for cache in caches:
        verifier.commit(cache, len(more))
    assert caches[0].meta_state == caches[1].meta_state
    for block, extended in zip(caches[0].state, caches[1].state, strict=True):
        assert block is not None and extended is not None
        for a, b in zip(block, extended, strict=True):
            np.testing.assert_allclose(to_numpy(b), to_numpy(a), rtol=1e-5, atol=1e-5)


def test_a_parked_dense_cache_holds_its_resident_kv_and_no_growth_room_and_continues_unchanged(verifiers):
    verifier = verifiers["qwen3"]
    prompt, more = _tokens(7, 300), _tokens(8, 5)
    parked, kept = verifier.new_cache(FullStrategy()), verifier.new_cache(FullStrategy())
    for cache in (parked, kept):
        for start in range(0, 300, 100):  # appends grow the buffers geometrically: room beyond 300 slots
            verifier.verify(cache, prompt[start : start + 100], 1)
            verifier.commit(cache, 100)
    per_slot = sum(layer.nbytes for layer in parked._layers) // parked._slots.capacity
    assert parked._slots.capacity > 300
    parked.park()
    # Read from the arrays themselves: K and V of exactly the 300 resident positions in every layer.
    assert {int(array.shape[2]) for array in parked.arrays()} == {300}
    assert len(parked.arrays()) == 2 * parked.num_layers
    assert sum(layer.nbytes for layer in parked._layers) == 300 * per_slot
    expected = to_numpy(verifier.verify(kept, more, len(more)).logits)
    np.testing.assert_array_equal(to_numpy(verifier.verify(parked, more, len(more)).logits), expected)


def test_a_cache_reports_what_it_held_as_its_last_forward_ended_until_it_parks(verifiers):
    verifier = verifiers["qwen3"]
    cache = verifier.new_cache(FullStrategy())
    assert cache.footprint().forward_bytes == 0
    verifier.verify(cache, _tokens(11, 40), 1)
    staged = cache.nbytes  # the 40 positions staged, none committed yet
    verifier.commit(cache, 40)
    assert cache.footprint().forward_bytes == staged > 0
    verifier.verify(cache, _tokens(12, 8), 8)  # a block of which the commit keeps 3
    staged = cache.nbytes
    verifier.commit(cache, 3)
    assert cache.footprint().forward_bytes == staged
    cache.park()
    assert cache.footprint().forward_bytes == 0 < cache.footprint().nbytes


def test_a_generation_reserves_room_for_what_it_can_fill_not_half_the_history_again(verifiers):
    verifier = verifiers["qwen3"]
    cache = verifier.new_cache(FullStrategy())
    seq = SequenceState(cache=cache, tokens=_tokens(9, 300))
    decoder = Decoder(verifier, prefill_chunk_tokens=7)

    def slots() -> int:
        """The slots every K/V buffer has room for (read from the arrays themselves)."""
        (room,) = {int(array.shape[2]) for array in cache.arrays()}
        return room

    def generate(count: int, *, bound: int) -> None:
        budget, generated = GenerationBudget(max_new_tokens=count), 0
        while generated < count:
            generated += len(decoder.step(seq, SamplingParams(), budget, generated).tokens)
            # What the history and this generation can fill: not geometric growth's half of the history again.
            assert slots() <= bound

    generate(4, bound=300 + 4)
    cache.park()
    assert slots() == 303  # every position but the last generated token's, which is pending
    seq.tokens += _tokens(10, 4)
    generate(6, bound=308 + 6)
    cache.park()
    cache.begin_stage(1)  # outside a generation nothing bounds it: appends grow geometrically
    assert slots() >= 313 + 313 // 2


def test_a_long_history_s_keys_and_values_share_one_allocation_with_room_for_whole_key_blocks(verifiers, backend):
    """Where attention reads keys in whole blocks past a buffer's end (the torch direct forward on a CPU), a long
    unbounded history's K/V are read in place: each layer's keys and values lie in one allocation with zeroed room
    after them, which the cache's bytes count and parking drops; a short history, or a bounded cache, has none;
    the values are those of buffers without the room. MLX's attention reads no further than the keys: no room."""
    verifier = verifiers["qwen3"]
    assert verifier.key_block  # the direct forward, and MLX on a Linux CPU, read whole key blocks
    prompt, more = _tokens(11, 1100), _tokens(12, 6)
    roomy, plain, short = (verifier.new_cache(FullStrategy()) for _ in range(3))
    bounded = verifier.new_cache(SinkWindowStrategy(sink=4, window=1000))
    for layer in plain._layers:
        layer.read_past = 0
    for cache, tokens in ((roomy, prompt), (plain, prompt), (short, prompt[:300]), (bounded, prompt)):
        verifier.verify(cache, tokens, 1)
        verifier.commit(cache, len(tokens))

    def shared(cache: KVSessionCache[Any]) -> set[bool]:
        if backend != "torch":
            return {False}
        return {
            layer._keys.untyped_storage().data_ptr() == layer._values.untyped_storage().data_ptr()
            for layer in cache._layers
        }

    def slot_bytes(cache: KVSessionCache[Any]) -> int:
        return sum(cache.ops.nbytes(array) for array in cache.arrays())

    paired = backend == "torch"
    head_dim = COMMON_SHAPE["hidden_size"] // COMMON_SHAPE["num_attention_heads"]
    room = (verifier.key_block - 1) * head_dim * 4 if paired else 0  # bytes per layer
    assert shared(roomy) == {paired} and shared(plain) == shared(short) == shared(bounded) == {False}
    assert sum(layer.nbytes for layer in roomy._layers) == slot_bytes(roomy) + roomy.num_layers * room
    assert sum(layer.nbytes for layer in short._layers) == slot_bytes(short)
    held = roomy.footprint().dense_equivalent_bytes
    assert held == plain.footprint().dense_equivalent_bytes == slot_bytes(plain) * 1100 // plain._slots.capacity
    assert roomy.footprint().working_bytes >= roomy.num_layers * room
    expected = to_numpy(verifier.verify(plain, more, len(more)).logits)
    np.testing.assert_array_equal(to_numpy(verifier.verify(roomy, more, len(more)).logits), expected)
    for cache in (roomy, plain):
        verifier.commit(cache, 0)
        cache.park()
    assert shared(roomy) == {False}
    assert sum(layer.nbytes for layer in roomy._layers) == slot_bytes(roomy) == slot_bytes(plain)
