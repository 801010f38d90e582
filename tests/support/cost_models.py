"""Cost models measured as a test needs them."""

from __future__ import annotations

from kv_cache_proposer.proposers.cost_model import DraftCostModel

PLAIN_S = 0.010


def measured_model(
    draft_s: float, verify_s: float, accepted: int, *, limit: int = 4, drafts: int = 20
) -> DraftCostModel:
    """A model that saw `drafts` proposals of `limit` tokens, each taking `draft_s` and accepted up to `accepted`,
    verified in `verify_s`, and plain steps of `PLAIN_S`."""
    model = DraftCostModel(limit)
    for _ in range(drafts):
        model.observe_draft(limit, accepted, draft_s)
        model.observe_forward(limit + 1, verify_s)
    model.observe_forward(1, PLAIN_S)
    return model
