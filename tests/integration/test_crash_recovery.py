"""Sessions survive SIGKILL: a real daemon with --state-dir is killed at random moments while clients append and
stream, and every acknowledged or received token is back after the restart."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest

from inference_engine.generated import runtime_pb2 as pb
from inference_engine.generated import runtime_pb2_grpc
from tests.support.daemon import Daemon

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

ROUNDS = 4
SESSIONS = 3
MAX_TOKENS = 6


@pytest.fixture
def daemon() -> Iterator[type[Daemon]]:
    started: list[Daemon] = []

    def start(*args: str) -> Daemon:
        process = Daemon(*args)
        started.append(process)
        return process

    yield start  # type: ignore[misc]
    for process in started:
        process.kill()


@dataclass
class _Client:
    """What one client knows of its session: every token acknowledged or received, and the call in flight."""

    session_id: str
    known: list[int]
    in_flight: tuple[str, list[int] | int] | None = None
    calls: int = 0
    errors: list[grpc.StatusCode] = field(default_factory=list)

    def drive(self, stub: runtime_pb2_grpc.RuntimeServiceStub, rng: random.Random, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                if rng.random() < 0.5:
                    tokens = [rng.randrange(3, 250) for _ in range(rng.randint(1, 12))]
                    self.in_flight = ("append", tokens)
                    stub.AppendTokens(pb.AppendTokensRequest(session_id=self.session_id, token_ids=tokens))
                    self.known.extend(tokens)
                else:
                    self.in_flight = ("generate", MAX_TOKENS)
                    request = pb.GenerateRequest(session_id=self.session_id, max_tokens=MAX_TOKENS)
                    for reply in stub.Generate(request):
                        if reply.WhichOneof("payload") == "token_id":
                            self.known.append(reply.token_id)
                self.in_flight = None
                self.calls += 1
        except grpc.RpcError as exc:
            self.errors.append(exc.code())


def _serve(daemon, state_dir) -> tuple[Daemon, grpc.Channel, runtime_pb2_grpc.RuntimeServiceStub]:
    process = daemon("serve", "--port", "0", "--metrics-port", "-1", "--log-format", "json", "--state-dir", state_dir)
    host, port = process.wait_listening()
    channel = grpc.insecure_channel(f"{host}:{port}")
    return process, channel, runtime_pb2_grpc.RuntimeServiceStub(channel)


def _history(stub, session_id: str) -> list[int]:
    info = stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=session_id, history_tail_tokens=60000))
    assert len(info.history_tail_token_ids) == info.history_length
    return list(info.history_tail_token_ids)


def _greedy(stub, session_id: str, max_tokens: int) -> list[int]:
    replies = stub.Generate(pb.GenerateRequest(session_id=session_id, max_tokens=max_tokens))
    return [r.token_id for r in replies if r.WhichOneof("payload") == "token_id"]


def _fresh(stub, history: list[int]) -> str:
    return stub.CreateSession(pb.CreateSessionRequest(initial_token_ids=history)).session_id


def test_every_acknowledged_and_received_token_survives_sigkill_over_several_rounds(daemon, tmp_path):
    state_dir = str(tmp_path / "state")
    rng = random.Random(19)
    process, channel, stub = _serve(daemon, state_dir)
    clients = []
    for i in range(SESSIONS):
        prompt = [rng.randrange(3, 250) for _ in range(20 + i)]
        session_id = stub.CreateSession(pb.CreateSessionRequest(initial_token_ids=prompt, client_label=f"c{i}"))
        clients.append(_Client(session_id.session_id, prompt))
    for round_index in range(ROUNDS):
        stop = threading.Event()
        threads = [
            threading.Thread(target=c.drive, args=(stub, random.Random(round_index * 100 + i), stop))
            for i, c in enumerate(clients)
        ]
        for thread in threads:
            thread.start()
        time.sleep(rng.uniform(0.4, 2.0))
        process.kill()  # SIGKILL, with appends and streams in flight
        stop.set()
        for thread in threads:
            thread.join(30)
        channel.close()

        process, channel, stub = _serve(daemon, state_dir)
        for client in clients:
            history = _history(stub, client.session_id)
            known = client.known
            assert history[: len(known)] == known, f"round {round_index}: an acknowledged or received token is lost"
            extra = history[len(known) :]
            if extra:
                # Only the call in flight at the kill may have left more: its append, or tokens of its generation
                # that were committed (and journaled) but never reached the client.
                assert client.in_flight is not None, f"round {round_index}: tokens appeared from nowhere"
                kind, what = client.in_flight
                if kind == "append":
                    assert extra == what
                else:
                    assert len(extra) <= MAX_TOKENS
                    assert extra == _greedy(stub, _fresh(stub, known), len(extra)), "they are the model's tokens"
            client.known = history
            client.in_flight = None
        assert sum(c.calls for c in clients) > 0

    for client in clients:
        info = stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=client.session_id))
        assert info.pending_token_count == info.history_length, "restored sessions rebuild their K/V on first use"
        reference = _fresh(stub, client.known)
        assert _greedy(stub, client.session_id, 8) == _greedy(stub, reference, 8)
    channel.close()
    process.terminate()
    assert process.wait() == 0


def test_after_sigkill_a_session_reads_its_kv_back_and_prefills_nothing_but_its_pending_token(daemon, tmp_path):
    state_dir = str(tmp_path / "state")
    history = [random.Random(5).randrange(3, 250) for _ in range(300)]
    process, channel, stub = _serve(daemon, state_dir)
    restarted, reference = _fresh(stub, history), _fresh(stub, history)
    assert _greedy(stub, restarted, 8) == _greedy(stub, reference, 8)
    expected = _greedy(stub, reference, 8)
    process.kill()  # right after the last Done: the K/V of that generation were written before it was sent
    channel.close()

    process, channel, stub = _serve(daemon, state_dir)
    replies = list(stub.Generate(pb.GenerateRequest(session_id=restarted, max_tokens=8)))
    assert [r.token_id for r in replies if r.WhichOneof("payload") == "token_id"] == expected
    done = replies[-1].done
    assert done.prefill_token_count == 1, "the history's K/V were read back, not prefilled"
    channel.close()
