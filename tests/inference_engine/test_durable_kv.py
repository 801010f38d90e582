"""K/V kept beside the journal (`--state-kv`): a restarted session reads back what it held, continues exactly as it
would have, and falls back to prefilling whatever its files do not hold."""

from __future__ import annotations

import numpy as np
import pytest

from inference_engine.durable_kv import KV_DIR
from inference_engine.generated import runtime_pb2 as pb
from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from tests.support.backends import BACKENDS
from tests.support.server import create, generate, info, start_server

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

HISTORY = list(range(10, 70))
TURN = [5, 6, 7, 8]


def _append(stub, session_id: str, tokens: list[int]) -> None:
    stub.AppendTokens(pb.AppendTokensRequest(session_id=session_id, token_ids=tokens))


def _uninterrupted(serve) -> tuple[list[int], list[int]]:
    """The two generations of the reference session, with no restart between them."""
    server = serve("qwen3")
    session = create(server.stub, initial=HISTORY)
    first = generate(server.stub, session, max_tokens=10).tokens
    _append(server.stub, session, TURN)
    return first, generate(server.stub, session, max_tokens=10).tokens


def _bytes(state, session: str) -> int:
    return sum(path.stat().st_size for path in _chunks(state, session))


def _counter(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def _chunks(state, session: str) -> list:
    return sorted((state / KV_DIR / session).glob("*.npz"))


def _left_behind(serve, state) -> str:
    """A session that generated once on a daemon of `state`, which then stopped: its K/V are in one file."""
    server = serve("qwen3", state_dir=str(state))
    session = create(server.stub, initial=HISTORY)
    generate(server.stub, session, max_tokens=10)
    server.stop()
    return session


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_restarted_session_reads_its_kv_back_and_prefills_only_its_new_tokens(serve, tmp_path, backend):
    first_ref, second_ref = _uninterrupted(serve)

    first = serve("qwen3", state_dir=str(tmp_path))
    session = create(first.stub, initial=HISTORY)
    assert generate(first.stub, session, max_tokens=10).tokens == first_ref
    held = len(HISTORY) + 10 - 1  # the last generated token stays pending
    assert _counter(first.metrics_text(), "kakeya_session_kv_written_positions_total") == held
    assert len(_chunks(tmp_path, session)) == 1
    first.stop()

    second = serve("qwen3", state_dir=str(tmp_path))
    _append(second.stub, session, TURN)
    after = generate(second.stub, session, max_tokens=10)
    assert after.tokens == second_ref
    assert after.done is not None and after.done.prefill_token_count == 1 + len(TURN)
    assert _counter(second.metrics_text(), "kakeya_session_kv_read_back_positions_total") == held
    assert len(_chunks(tmp_path, session)) == 2, "the second park wrote only the positions it added"


def test_kv_held_at_bfloat16_are_written_in_two_bytes_a_value_and_read_back_exactly(checkpoints, tmp_path):
    verifier = TorchVerifier.load(checkpoints["qwen3"], device="cpu", dtype="float32", weights="int4")
    assert verifier.model_spec.kv_dtype == "bfloat16"  # auto, under int4 weights
    reference = start_server(verifier, model_dir=checkpoints["qwen3"])
    session = create(reference.stub, initial=HISTORY)
    first_ref = generate(reference.stub, session, max_tokens=10).tokens
    _append(reference.stub, session, TURN)
    second_ref = generate(reference.stub, session, max_tokens=10).tokens
    reference.stop()

    first = start_server(verifier, model_dir=checkpoints["qwen3"], state_dir=str(tmp_path))
    session = create(first.stub, initial=HISTORY)
    assert generate(first.stub, session, max_tokens=10).tokens == first_ref
    first.stop()
    [path] = _chunks(tmp_path, session)
    with np.load(path) as chunk:
        assert chunk["keys"].dtype == chunk["values"].dtype == np.uint16  # the bfloat16 values' bit patterns
        assert chunk["keys"].shape[2] == len(HISTORY) + 10 - 1

    second = start_server(verifier, model_dir=checkpoints["qwen3"], state_dir=str(tmp_path))
    try:
        _append(second.stub, session, TURN)
        after = generate(second.stub, session, max_tokens=10)
    finally:
        second.stop()
    assert after.tokens == second_ref  # the K/V read back are the ones held, bit for bit
    assert after.done is not None and after.done.prefill_token_count == 1 + len(TURN)


def test_files_that_disagree_with_the_journal_are_read_back_only_as_far_as_they_agree(serve, tmp_path):
    _, second_ref = _uninterrupted(serve)
    session = _left_behind(serve, tmp_path)
    (chunk,) = _chunks(tmp_path, session)
    with np.load(chunk) as data:
        arrays = {name: data[name].copy() for name in data.files}
    arrays["tokens"][40] += 1  # a file from a history the journal does not hold from position 40 on
    with open(chunk, "wb") as out:
        np.savez(out, **arrays)

    second = serve("qwen3", state_dir=str(tmp_path))
    _append(second.stub, session, TURN)
    after = generate(second.stub, session, max_tokens=10)
    assert after.tokens == second_ref
    held = len(HISTORY) + 10 - 1
    assert after.done is not None and after.done.prefill_token_count == held - 40 + 1 + len(TURN)
    assert _counter(second.metrics_text(), "kakeya_session_kv_read_back_positions_total") == 40
    second.stop()
    # The disagreeing chunk went; its 40 agreeing positions were written again from the cache with the rest.
    starts = [path.stem for path in _chunks(tmp_path, session)]
    assert starts == [f"{0:012d}"]


def test_a_damaged_file_is_not_read_and_the_history_is_prefilled(serve, tmp_path):
    _, second_ref = _uninterrupted(serve)
    session = _left_behind(serve, tmp_path)
    (chunk,) = _chunks(tmp_path, session)
    chunk.write_bytes(chunk.read_bytes()[:1000])

    second = serve("qwen3", state_dir=str(tmp_path))
    _append(second.stub, session, TURN)
    after = generate(second.stub, session, max_tokens=10)
    assert after.tokens == second_ref
    assert after.done is not None and after.done.prefill_token_count == len(HISTORY) + 10 + len(TURN)


def test_closing_a_session_removes_its_files_and_other_strategies_write_none(serve, tmp_path):
    server = serve("qwen3", state_dir=str(tmp_path))
    full = create(server.stub, initial=HISTORY)
    window = create(
        server.stub, initial=HISTORY, kv_strategy=pb.KV_STRATEGY_SINK_WINDOW, sink_tokens=4, window_tokens=16
    )
    packed = create(server.stub, initial=HISTORY, kv_compressor=pb.KV_COMPRESSOR_KAKEYA_D4)
    for session in (full, window, packed):
        generate(server.stub, session, max_tokens=4)
    assert _chunks(tmp_path, full)
    assert not (tmp_path / KV_DIR / window).exists() and not (tmp_path / KV_DIR / packed).exists()
    server.stub.CloseSession(pb.CloseSessionRequest(session_id=full))
    assert not (tmp_path / KV_DIR / full).exists()


def test_state_kv_off_prefills_and_removes_the_files(serve, tmp_path):
    session = _left_behind(serve, tmp_path)
    second = serve("qwen3", state_dir=str(tmp_path), state_kv="off")
    assert not (tmp_path / KV_DIR).exists()
    after = generate(second.stub, session, max_tokens=4)
    assert after.done is not None and after.done.prefill_token_count == len(HISTORY) + 10
    assert info(second.stub, session).history_length == len(HISTORY) + 14


def test_files_of_another_model_are_removed_at_start(serve, tmp_path):
    session = _left_behind(serve, tmp_path)
    identity = tmp_path / KV_DIR / "identity.json"
    identity.write_text(identity.read_text().replace("float32", "bfloat16"))

    second = serve("qwen3", state_dir=str(tmp_path))
    assert not (tmp_path / KV_DIR / session).exists()
    after = generate(second.stub, session, max_tokens=4)
    assert after.done is not None and after.done.prefill_token_count == len(HISTORY) + 10


def test_files_stay_within_the_byte_bound_the_least_recently_written_session_going_first(serve, tmp_path):
    one = _bytes(tmp_path / "measure", _left_behind(serve, tmp_path / "measure"))  # one session's file
    bound = one * 5 // 2
    server = serve("qwen3", state_dir=str(tmp_path / "state"), state_kv_max_bytes=bound)
    state = tmp_path / "state"
    sessions = [create(server.stub, initial=[token + i for token in HISTORY]) for i in range(3)]  # no shared prefix
    for session in sessions[:2]:
        generate(server.stub, session, max_tokens=10)
    assert _counter(server.metrics_text(), "kakeya_session_kv_file_bytes") == 2 * one
    generate(server.stub, sessions[2], max_tokens=10)  # a third file would pass the bound: the oldest goes
    assert [bool(_chunks(state, session)) for session in sessions] == [False, True, True]
    assert _counter(server.metrics_text(), "kakeya_session_kv_file_bytes") == 2 * one <= bound
    _append(server.stub, sessions[0], TURN)
    generate(server.stub, sessions[0], max_tokens=4)  # written again from its first position: the second goes
    assert [bool(_chunks(state, session)) for session in sessions] == [True, False, True]
    assert _chunks(state, sessions[0])[0].stem == f"{0:012d}"
    server.stop()

    restarted = serve("qwen3", state_dir=str(state), state_kv_max_bytes=bound)
    pending = {}
    for index in (0, 2, 1):  # the one without files last: its first write removes others' files
        _append(restarted.stub, sessions[index], TURN)
        pending[index] = generate(restarted.stub, sessions[index], max_tokens=4).done.prefill_token_count
    assert pending[0] == pending[2] == 1 + len(TURN)
    assert pending[1] == len(HISTORY) + 10 + len(TURN), "the session whose files went prefills its history"


def test_a_session_that_alone_would_pass_the_bound_writes_no_file(serve, tmp_path):
    one = _bytes(tmp_path / "measure", _left_behind(serve, tmp_path / "measure"))
    server = serve("qwen3", state_dir=str(tmp_path / "state"), state_kv_max_bytes=one - 1)
    session = create(server.stub, initial=HISTORY)
    generate(server.stub, session, max_tokens=10)
    assert not _chunks(tmp_path / "state", session)
    text = server.metrics_text()
    assert _counter(text, "kakeya_session_kv_written_positions_total") == 0
    assert _counter(text, "kakeya_session_kv_file_bytes") == 0
