"""Draft proposers for the speculative loop, and loading one by name."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kv_cache_proposer.errors import ModelLoadError
from kv_cache_proposer.proposers.base import DraftSession, NoDraftSession, NoProposer, Proposer
from kv_cache_proposer.proposers.ngram import LOOKAHEAD, MAX_N, MIN_N, NgramProposer
from kv_cache_proposer.verifier import Verifier

PROPOSERS = ("none", "ngram", "draft_model", "dflash")
DEFAULT_DRAFT_TOKENS = {"ngram": LOOKAHEAD, "draft_model": 4}


@dataclass(frozen=True, slots=True)
class ProposerOptions:
    """How to build a proposer. Zero means the proposer's own default."""

    name: str = "none"
    draft_model: str | Path | None = None  # draft_model: a checkpoint directory; dflash: the drafter directory
    num_draft_tokens: int = 0  # most drafted tokens per step
    block_size: int = 0  # dflash: block size (at most the drafter's)
    ngram_max_n: int = MAX_N
    ngram_min_n: int = MIN_N
    prefill_chunk_tokens: int = 0  # draft_model: pending tokens per prefill forward (0: the model's default)

    def __post_init__(self) -> None:
        if self.name not in PROPOSERS:
            raise ValueError(f"unknown proposer {self.name!r}; expected one of {', '.join(PROPOSERS)}")
        if self.name in ("draft_model", "dflash") and not self.draft_model:
            where = "--draft-model" + (", or a dflash/ subdirectory of the model" if self.name == "dflash" else "")
            raise ValueError(f"the {self.name} proposer needs a model directory ({where})")
        if self.num_draft_tokens < 0 or self.block_size < 0 or self.prefill_chunk_tokens < 0:
            raise ValueError("num_draft_tokens, block_size and prefill_chunk_tokens must be >= 0")
        if self.block_size == 1:
            raise ValueError("a DFlash block holds the last token plus at least one draft: block_size >= 2")
        if not 1 <= self.ngram_min_n <= self.ngram_max_n:
            raise ValueError(f"ngram sizes need 1 <= min <= max, got {self.ngram_min_n} and {self.ngram_max_n}")


def load_proposer(
    options: ProposerOptions,
    verifier: Verifier[Any],
    *,
    backend: str,
    device: str = "auto",
    dtype: str = "auto",
    torch_forward: str = "auto",
    compile: str = "auto",
) -> Proposer:
    """Build the proposer `options` names for `verifier` (loaded by `backend`; a draft model is loaded by the same
    backend on `device` with `dtype`, and on torch runs its forwards as `torch_forward` and `compile` say)."""
    drafts = options.num_draft_tokens or DEFAULT_DRAFT_TOKENS.get(options.name, 0)
    if options.name == "none":
        return NoProposer()
    if options.name == "ngram":
        return NgramProposer(max_n=options.ngram_max_n, min_n=options.ngram_min_n, lookahead=drafts)
    assert options.draft_model is not None
    if options.name == "draft_model":
        from kv_cache_proposer.backends import load_verifier
        from kv_cache_proposer.proposers.draft_model import DraftModelProposer

        model = load_verifier(
            backend, options.draft_model, device=device, dtype=dtype, torch_forward=torch_forward, compile=compile
        )
        chunk = options.prefill_chunk_tokens or model.prefill_chunk_tokens
        return DraftModelProposer(model, verifier, max_draft_tokens=drafts, prefill_chunk=chunk)
    limit = options.block_size - 1 if options.block_size else 0
    if options.num_draft_tokens:
        limit = min(limit, options.num_draft_tokens) if limit else options.num_draft_tokens
    if backend == "mlx":
        from kv_cache_proposer.backends.mlx_backend.verifier import MlxVerifier
        from kv_cache_proposer.proposers.dflash.mlx_proposer import MlxDFlashProposer

        if not isinstance(verifier, MlxVerifier):
            raise ModelLoadError("the MLX DFlash drafter reads the layer outputs of an MLX verifier")
        return MlxDFlashProposer.load(options.draft_model, verifier, max_draft_tokens=limit)
    from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
    from kv_cache_proposer.proposers.dflash.proposer import DFlashProposer

    if not isinstance(verifier, TorchVerifier):
        raise ModelLoadError("the PyTorch DFlash drafter reads the layer outputs of a PyTorch verifier")
    return DFlashProposer.load(options.draft_model, verifier, max_draft_tokens=limit)


__all__ = [
    "PROPOSERS",
    "DraftSession",
    "NoDraftSession",
    "NoProposer",
    "Proposer",
    "ProposerOptions",
    "load_proposer",
]
