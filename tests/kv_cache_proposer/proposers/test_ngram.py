"""Prompt-lookup drafting: which suffix matches, what it proposes, and the defaults the daemon builds it with."""

from __future__ import annotations

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
