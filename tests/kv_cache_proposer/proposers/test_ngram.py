"""Prompt-lookup drafting: which suffix matches, what it proposes, and the defaults the daemon builds it with."""

from __future__ import annotations

import random
import tracemalloc

from kv_cache_proposer.proposers import ProposerOptions, load_proposer
from kv_cache_proposer.proposers.ngram import NgramProposer
from kv_cache_proposer.strategies import FullStrategy


def _propose(proposer: NgramProposer, history: list[int], limit: int = 16) -> list[int]:
    return proposer.open(FullStrategy()).propose(history, limit)


def test_a_suffix_of_one_token_drafts_nothing_by_default_and_two_tokens_draft_what_followed() -> None:
    # 7 occurred before (followed by 8 9); the suffix 5 7 never did.
    one_token = [1, 2, 7, 8, 9, 3, 4, 5, 7]
    assert _propose(NgramProposer(), one_token) == []
    assert _propose(NgramProposer(min_n=1), one_token) == [8, 9, 3, 4, 5, 7]
    # 4 7 occurred before: what followed it is proposed, up to the end of the history.
    two_tokens = [1, 4, 7, 8, 9, 3, 4, 7]
    assert _propose(NgramProposer(), two_tokens) == [8, 9, 3, 4, 7]


def test_the_longest_matching_suffix_wins_and_its_latest_occurrence() -> None:
    history = [3, 4, 5, 10, 11, 0, 4, 5, 20, 21, 0, 3, 4, 5]
    # The three-token suffix 3 4 5 occurred once, at the start; 4 5 occurred twice, latest before 20.
    assert _propose(NgramProposer(), history, 2) == [10, 11]
    assert _propose(NgramProposer(max_n=2), history, 2) == [20, 21]


def test_the_daemon_s_ngram_drafts_at_most_seven_tokens_after_a_two_token_match() -> None:
    proposer = load_proposer(ProposerOptions(name="ngram"), verifier=None, backend="torch")  # type: ignore[arg-type]
    assert isinstance(proposer, NgramProposer)
    assert (proposer.min_n, proposer.max_n, proposer.lookahead) == (2, 4, 7)
    history = [*range(100, 120), 1, 2, *range(200, 220), 1, 2]
    session = proposer.open(FullStrategy())
    assert session.propose(history, session.max_draft_tokens) == list(range(200, 207))


def test_commits_index_the_history_and_forks_propose_from_their_own() -> None:
    """Committed positions are indexed as they commit (a session drafts as one that indexed on its first
    proposal), and a fork proposes from its own history only: a fork at the end keeps the parent's index, one
    from an earlier point never proposes what followed that point in the parent."""
    history = [1, 2, 10, 11, 12, 1, 2, 20, 21, 22, 5, 6]
    committed = NgramProposer().open(FullStrategy())
    for end in range(1, len(history)):  # committed one position at a time, the next token pending
        committed.on_commit(history[: end + 1], end, None)
    fresh = NgramProposer().open(FullStrategy())
    for suffix in ([1, 2], [5, 6], [10, 11]):
        assert committed.propose([*history, *suffix], 4) == fresh.propose([*history, *suffix], 4)
    assert committed.propose([*history, 1, 2], 4) == [20, 21, 22, 5]

    at_end = committed.clone(len(history) - 1)
    assert at_end.propose([*history, 1, 2], 4) == [20, 21, 22, 5]
    early = committed.clone(4)  # its history: 1 2 10 11 12, then its own tokens
    fork_history = [*history[:5], 40, 41, 1, 2]
    assert early.propose(fork_history, 4) == [10, 11, 12, 40]  # not what followed the parent's later 1 2


def test_the_index_counts_its_bytes_as_the_session_s_drafting_state() -> None:
    rng = random.Random(3)
    history = [300 + rng.randrange(1000) for _ in range(20_000)]
    session = NgramProposer().open(FullStrategy())
    assert session.nbytes == 0  # nothing indexed
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        session.on_commit(history, len(history), None)
        allocated = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # Within a tenth of what Python allocated for it (tuples it reuses from its free lists are not allocated anew).
    assert 0.9 * allocated <= session.nbytes <= 1.1 * allocated
    fork = session.clone(len(history))  # a fork at the end holds a copy
    assert fork.nbytes == session.nbytes
    session.release()
    assert session.nbytes == 0
