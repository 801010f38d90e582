"""GetSessionInfo right after a client cancelled its Generate stream reports the generation as ended."""

from __future__ import annotations

from inference_engine.generated import runtime_pb2 as pb
from tests.support.server import create, info


def test_info_right_after_a_cancel_no_longer_reports_generating(serve):
    server = serve("qwen3")
    for _ in range(10):
        session_id = create(server.stub, initial=[1, 2, 3])
        stream = server.stub.Generate(pb.GenerateRequest(session_id=session_id, max_tokens=4000))
        next(stream)
        next(stream)
        stream.cancel()
        described = info(server.stub, session_id)
        assert not described.generating
        assert described.history_length >= 5


def test_info_of_a_running_generation_still_reports_generating(serve):
    server = serve("qwen3")
    session_id = create(server.stub, initial=[1, 2, 3])
    stream = server.stub.Generate(pb.GenerateRequest(session_id=session_id, max_tokens=4000))
    next(stream)
    assert info(server.stub, session_id).generating
    stream.cancel()
