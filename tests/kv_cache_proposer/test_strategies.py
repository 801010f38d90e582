import pytest
import torch

from kv_cache_proposer.strategies import FullStrategy, SinkWindowStrategy, make_strategy


def test_full_strategy_keeps_every_position_in_its_own_slot():
    full = FullStrategy()
    assert [full.slot_of(p) for p in range(5)] == [0, 1, 2, 3, 4]
    assert full.resident_count(1000) == 1000
    assert full.bounded_slots is None


def test_sink_window_maps_the_window_onto_a_ring_after_the_sink():
    strategy = SinkWindowStrategy(sink=2, window=3)
    assert [strategy.slot_of(p) for p in range(9)] == [0, 1, 2, 3, 4, 2, 3, 4, 2]
    assert [strategy.resident_count(n) for n in (0, 3, 5, 6, 100)] == [0, 3, 5, 5, 5]


def test_sink_window_query_sees_sink_and_the_last_window_positions():
    strategy = SinkWindowStrategy(sink=2, window=3)
    q = torch.tensor([[10]])
    keys = torch.arange(11)[None, :]
    visible = strategy.visible(q, keys)[0].tolist()
    assert [k for k in range(11) if visible[k]] == [0, 1, 7, 8, 9, 10]


@pytest.mark.parametrize(("sink", "window"), [(-1, 4), (0, 0)])
def test_sink_window_rejects_invalid_sizes(sink, window):
    with pytest.raises(ValueError):
        SinkWindowStrategy(sink=sink, window=window)


def test_make_strategy_names_the_known_strategies():
    assert make_strategy("full") == FullStrategy()
    assert make_strategy("sink_window", sink=1, window=2) == SinkWindowStrategy(1, 2)
    with pytest.raises(ValueError, match="unknown KV strategy"):
        make_strategy("paged")
