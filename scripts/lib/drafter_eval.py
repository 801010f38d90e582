"""Measurements of a DFlash drafter against its verifier: held-out acceptance by teacher-forced blocks (per row, per
context window) and by real greedy speculative decoding, and the weights of a training run's best measurement."""

from __future__ import annotations

import argparse
from typing import Any, cast

import numpy as np
import torch

from kv_cache_proposer.backends.torch_backend.features import concatenated, layer_outputs
from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from kv_cache_proposer.decoding import Decoder, GenerationBudget, SequenceState
from kv_cache_proposer.proposers.base import DraftPolicy
from kv_cache_proposer.proposers.dflash.config import DFlashSpec
from kv_cache_proposer.proposers.dflash.model import DFlashDrafter
from kv_cache_proposer.proposers.dflash.proposer import DFlashProposer
from kv_cache_proposer.proposers.dflash.training import block_loss
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import FullStrategy
from lib.drafter_rows import Rows


def features_of(verifier: TorchVerifier, tokens: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
    """The verifier's outputs of `layers` for every position [N, L, F], exactly as verify forwards capture them."""
    with torch.no_grad(), layer_outputs(verifier.model, layers) as captured:
        verifier.model(input_ids=tokens)
    return concatenated(captured, layers).float()


def mean_acceptance_length(
    drafter: DFlashDrafter, spec: DFlashSpec, verifier: TorchVerifier, prompts: list[list[int]], tokens: int
) -> dict[str, float]:
    """Greedy speculative decoding of `tokens` tokens after each prompt, every proposal a full block: tokens per
    verifier step, and the fraction of drafted tokens accepted."""
    proposer = DFlashProposer(drafter, spec, verifier)
    decoder = Decoder(verifier, draft_policy=DraftPolicy.FULL)
    steps = generated = drafted = accepted = 0
    for prompt in prompts:
        seq = SequenceState(
            cache=verifier.new_cache(FullStrategy()), tokens=list(prompt), draft_session=proposer.open(FullStrategy())
        )
        budget = GenerationBudget(max_new_tokens=tokens)
        produced = 0
        while produced < tokens:
            step = decoder.step(seq, SamplingParams(), budget, produced)
            produced += len(step.tokens)
            if step.drafted:
                steps += 1
                generated += len(step.tokens)
                drafted += step.drafted
                accepted += step.accepted
            if step.stop is not None:
                break
        seq.cache.release()
        seq.draft_session.release()
    return {
        "mean_acceptance_length": generated / steps if steps else 0.0,
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "drafting_steps": steps,
    }


def row_acceptance(
    drafter: DFlashDrafter,
    spec: DFlashSpec,
    verifier: TorchVerifier,
    held: Rows,
    args: argparse.Namespace,
    windows: list[int] | None = None,
) -> dict[int | None, list[float]]:
    """Per window (None: the drafter's own layer windows; 0: the whole context) and held-out row: the mean greedy
    acceptance length of blocks anchored at every continuation position. Rows with no such block are left out."""
    embed = cast(torch.Tensor, verifier.model.get_input_embeddings().weight)
    head = verifier.model.get_output_embeddings()
    lengths = held.row_lengths()
    chosen: list[int | None] = list(windows) if windows is not None else [None]
    per_row: dict[int | None, list[float]] = {w: [] for w in chosen}
    drafter.eval()
    with torch.no_grad():
        for index in held.scored():
            length, first = int(lengths[index]), int(held.first_anchor[index])
            tokens = np.pad(held.tokens[index, :length], (0, args.block_size))
            tokens_t = torch.from_numpy(tokens[None]).to(verifier.device)
            features = features_of(verifier, tokens_t, spec.target_layer_ids)
            for window in chosen:
                stats = block_loss(
                    drafter,
                    embed,
                    head,
                    tokens_t,
                    features,
                    torch.arange(first, length - 1),
                    block_size=args.block_size,
                    mask_token_id=spec.mask_token_id,
                    gamma=args.gamma,
                    lengths=torch.tensor([length]),
                    windows=None if window is None else [window or None] * len(drafter.layers),
                )
                per_row[window].append(stats.acceptance_length)
    drafter.train()
    return per_row


def held_out_acceptance(
    drafter: DFlashDrafter, spec: DFlashSpec, verifier: TorchVerifier, held: Rows, args: argparse.Namespace
) -> float:
    """Mean greedy acceptance length over blocks anchored at every continuation position of the held-out rows."""
    per_row = row_acceptance(drafter, spec, verifier, held, args)[None]
    return float(np.mean(per_row)) if per_row else 0.0


def acceptance_by_window(
    drafter: DFlashDrafter, spec: DFlashSpec, verifier: TorchVerifier, held: Rows, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Held-out acceptance length per row under each training window, with the row's prompt length."""
    kept = held.scored()
    windows = sorted(set(args.train_windows or [args.sliding_window]))
    per_window = row_acceptance(drafter, spec, verifier, held, args, windows)
    return [
        {"window": window, "prompt_tokens": int(held.first_anchor[index]), "acceptance": acceptance}
        for window in windows
        for index, acceptance in zip(kept, per_window[window], strict=True)
    ]


class BestDrafter:
    """The weights of the best held-out acceptance so far in a training run (copied on the drafter's device)."""

    def __init__(self) -> None:
        self.step = 0
        self.acceptance: float | None = None
        self.weights: dict[str, torch.Tensor] | None = None

    def offer(self, step: int, acceptance: float, drafter: DFlashDrafter) -> None:
        if self.acceptance is None or acceptance > self.acceptance:
            self.step, self.acceptance = step, acceptance
            self.weights = {name: value.detach().clone() for name, value in drafter.state_dict().items()}

    def restore(self, drafter: DFlashDrafter) -> int:
        """Load the best weights into `drafter`; their step (0 when nothing was measured)."""
        if self.weights is not None:
            drafter.load_state_dict(self.weights)
        return self.step
