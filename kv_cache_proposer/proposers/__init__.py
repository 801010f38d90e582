"""Draft proposers for the speculative loop."""

from kv_cache_proposer.proposers.base import DraftSession, NoDraftSession, NoProposer, Proposer

__all__ = ["DraftSession", "NoDraftSession", "NoProposer", "Proposer"]
