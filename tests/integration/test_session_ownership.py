"""The ownership rule of a shared journal, on two real daemons called directly (no proxy): the daemon a call
reaches takes the session over, the previous owner's next write is refused and it drops its stale copy, and two
daemons never append to one history."""

from __future__ import annotations

from collections.abc import Iterator

import kakeya
import pytest

from tests.support.postgres import (  # noqa: F401 - postgres is a fixture
    ClusterDaemon,
    PostgresServer,
    fresh_database,
    postgres,
    start_daemons,
    stop_daemons,
)


@pytest.fixture(scope="module")
def pair(postgres: PostgresServer) -> Iterator[list[ClusterDaemon]]:  # noqa: F811
    daemons = start_daemons(fresh_database(postgres), 2)
    try:
        yield daemons
    finally:
        stop_daemons(daemons)


def _client(daemon: ClusterDaemon) -> kakeya.Client:
    return kakeya.Client(f"127.0.0.1:{daemon.grpc_port}", timeout_s=60)


def test_a_session_moves_to_the_daemon_its_call_reaches_and_the_stale_owner_loses_it(pair: list[ClusterDaemon]) -> None:
    a, b = pair
    with _client(a) as on_a, _client(b) as on_b:
        session_a = on_a.create_session(initial_tokens=[5, 6, 7, 8])
        known = [5, 6, 7, 8, *session_a.generate(3)]
        session_b = on_b.session(session_a.id)
        assert list(session_b.info(history_tail_tokens=64).history_tail) == known  # b takes it over
        assert b.metrics()["kakeya_cluster_session_takeovers_total"] == 1
        assert session_b.append([9]) == len(known) + 1
        known += [9, *session_b.generate(2)]

        with pytest.raises(kakeya.Unavailable, match="another daemon"):
            session_a.append([11])  # a is stale: refused, nothing appended
        assert a.metrics()["kakeya_cluster_sessions_lost_total"] == 1
        assert a.metrics()["kakeya_session_active"] == 0

        # a call reaching a again takes the session back, with b's tokens and without the refused one
        assert list(session_a.info(history_tail_tokens=64).history_tail) == known
        with pytest.raises(kakeya.Unavailable):
            session_b.append([12])
        continued = list(session_a.generate(4))
        with on_a.create_session(initial_tokens=known) as fresh:
            assert continued == list(fresh.generate(4))
        known += continued

        assert session_a.close() == len(known)
        with pytest.raises(kakeya.SessionNotFound):
            session_b.info()  # ended for every daemon


def test_an_id_the_shared_journal_does_not_hold_is_not_found(pair: list[ClusterDaemon]) -> None:
    with _client(pair[0]) as client, pytest.raises(kakeya.SessionNotFound):
        client.session("no-such-session").append([1])
