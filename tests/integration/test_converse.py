"""The bidirectional Converse stream: ordered commands, command ids, in-band cancel."""

from __future__ import annotations

import queue
import threading

from inference_engine.generated import runtime_pb2 as pb
from tests.support.server import converse, create, generate, info


def _kinds(events):
    return [(e.command_id, e.WhichOneof("event")) for e in events]


def test_commands_are_answered_in_order_with_their_ids(serve):
    server = serve("qwen3")
    sid = create(server.stub, initial=[1, 2, 3])
    events = converse(
        server.stub,
        [
            pb.ConverseRequest(command_id=10, bind=pb.BindCommand(session_id=sid)),
            pb.ConverseRequest(command_id=11, append=pb.AppendCommand(token_ids=[4, 5])),
            pb.ConverseRequest(command_id=12, generate=pb.GenerateCommand(max_tokens=3)),
            pb.ConverseRequest(command_id=13, append=pb.AppendCommand(token_ids=[6])),
        ],
    )
    assert _kinds(events) == [
        (10, "bound"),
        (11, "appended"),
        (12, "token_id"),
        (12, "token_id"),
        (12, "token_id"),
        (12, "done"),
        (13, "appended"),
    ]
    assert events[0].bound.history_length == 3 and events[1].appended.history_length == 5
    assert events[-1].appended.history_length == 9
    expected = generate(server.stub, create(server.stub, initial=[1, 2, 3, 4, 5]), max_tokens=3).tokens
    assert [e.token_id for e in events if e.WhichOneof("event") == "token_id"] == expected


def test_cancel_stops_the_running_generation_and_every_streamed_token_is_history(serve):
    server = serve("qwen3")
    sid = create(server.stub, initial=[7, 7, 7])
    commands: queue.Queue = queue.Queue()
    commands.put(pb.ConverseRequest(command_id=1, bind=pb.BindCommand(session_id=sid)))
    commands.put(pb.ConverseRequest(command_id=2, generate=pb.GenerateCommand(max_tokens=5000)))

    def requests():
        while (item := commands.get()) is not None:
            yield item

    events = []
    for event in server.stub.Converse(requests()):
        events.append(event)
        if len(events) == 6:  # bound + 5 tokens
            commands.put(pb.ConverseRequest(command_id=3, cancel=pb.CancelCommand()))
        if event.WhichOneof("event") == "done":
            commands.put(None)
    done = events[-1].done
    tokens = [e.token_id for e in events if e.WhichOneof("event") == "token_id"]
    assert done.stop_reason == pb.STOP_REASON_CANCELLED and done.generated_token_count == len(tokens) < 5000
    details = info(server.stub, sid, tail=len(tokens))
    assert details.history_length == 3 + len(tokens) and list(details.history_tail_token_ids) == tokens


def test_a_cancel_also_stops_a_generation_that_was_still_queued(serve):
    server = serve("qwen3")
    sid = create(server.stub, initial=[3, 1, 4])
    events = converse(
        server.stub,
        [
            pb.ConverseRequest(command_id=1, bind=pb.BindCommand(session_id=sid)),
            pb.ConverseRequest(command_id=2, generate=pb.GenerateCommand(max_tokens=4000)),
            pb.ConverseRequest(command_id=3, generate=pb.GenerateCommand(max_tokens=4000)),
            pb.ConverseRequest(command_id=4, cancel=pb.CancelCommand()),
        ],
    )
    dones = [e for e in events if e.WhichOneof("event") == "done"]
    assert [d.command_id for d in dones] == [2, 3]
    assert all(d.done.stop_reason == pb.STOP_REASON_CANCELLED for d in dones)


def test_two_streams_on_two_sessions_run_side_by_side(serve):
    server = serve("llama", max_concurrent=2)
    sids = [create(server.stub, initial=[i, i + 1]) for i in (1, 50)]
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        events = converse(
            server.stub,
            [
                pb.ConverseRequest(command_id=1, bind=pb.BindCommand(session_id=sids[i])),
                pb.ConverseRequest(command_id=2, generate=pb.GenerateCommand(max_tokens=30)),
            ],
        )
        results[i] = [e.token_id for e in events if e.WhichOneof("event") == "token_id"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i, start in enumerate((1, 50)):
        assert (
            results[i] == generate(server.stub, create(server.stub, initial=[start, start + 1]), max_tokens=30).tokens
        )
