"""Training pieces of the DFlash drafter: anchor-sampled blocks, the block mask, the position-decayed loss.

One training example is a token sequence with the frozen verifier's features at every position. Blocks start at
sampled anchors a: the block input is `[x_a, MASK x (B-1)]` at positions a..a+B-1 and its targets are
x_{a+1}..x_{a+B-1}. A block sees the context of every position before its anchor and its own block (both ways),
never another block nor anything at or after its anchor: exactly what it sees when drafting after position a-1
was committed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kv_cache_proposer.proposers.dflash.model import DFlashDrafter


def default_target_layers(num_verifier_layers: int, count: int) -> list[int]:
    """`count` verifier layers spread from the second to the third-last; a shallow verifier spreads them over
    every layer but the last instead."""
    if count < 1:
        raise ValueError("count must be >= 1")
    if count == 1:
        return [num_verifier_layers // 2]
    first, last = 1, num_verifier_layers - 3
    if last - first + 1 < count:
        first, last = 0, num_verifier_layers - 2
    count = min(count, last - first + 1)
    return sorted({round(first + i * (last - first) / (count - 1)) for i in range(count)}) if count > 1 else [first]


def sample_anchors(
    length: int, block_size: int, count: int, generator: torch.Generator, *, first: int = 1
) -> torch.Tensor:
    """`count` distinct anchors in [first, length - block_size], sorted [count]."""
    choices = length - block_size - first + 1
    if choices < count:
        raise ValueError(
            f"a sequence of {length} tokens holds fewer than {count} blocks of {block_size} from position {first}"
        )
    return torch.randperm(choices, generator=generator)[:count].sort().values + first


@dataclass(frozen=True, slots=True)
class BlockStats:
    """What one pass over a batch of blocks measured."""

    loss: torch.Tensor  # the weighted cross-entropy, with grad
    slot_accuracy: torch.Tensor  # [B-1] fraction of blocks whose slot k is the target
    acceptance_length: float  # mean over blocks of 1 + the leading correct slots: tokens per greedy verify step


def block_loss(
    drafter: DFlashDrafter,
    embed: torch.Tensor,
    head: torch.nn.Module,
    tokens: torch.Tensor,
    features: torch.Tensor,
    anchors: torch.Tensor,
    *,
    block_size: int,
    mask_token_id: int,
    gamma: float,
    embedding_scale: float = 1.0,
    lengths: torch.Tensor | None = None,
    windows: list[int | None] | None = None,
) -> BlockStats:
    """Weighted cross-entropy of every block, per-slot accuracy and the greedy acceptance length of the blocks.

    tokens [N, L]; features [N, L, F] (the verifier's, without grad); anchors [A] shared by the batch or [N, A] per
    row. Slot k of a block (k = 1..B-1) is weighted exp(-(k-1)/gamma). When `tokens` after each anchor are the
    verifier's own greedy continuation, the acceptance length is exactly what speculative greedy decoding accepts
    at those positions. `lengths` [N]: each row's real length when rows are right-padded (a block's slots at or past
    it are neither scored nor counted); `windows`: per drafter layer, the window to train under (default: the
    drafter config's).
    """
    n, length = tokens.shape
    device = tokens.device
    anchors = anchors.to(device)
    if anchors.dim() == 1:
        anchors = anchors[None].expand(n, -1)
    count = anchors.shape[1]
    offsets = torch.arange(block_size, device=device)
    block_pos = (anchors[:, :, None] + offsets).reshape(n, -1)  # [N, A*B]
    block_ids = tokens.gather(1, block_pos).view(n, count, block_size).clone()  # [N, A, B]
    targets = block_ids[:, :, 1:].clone()  # [N, A, B-1]
    block_ids[:, :, 1:] = mask_token_id
    embeds = F.embedding(block_ids.view(n, -1), embed) * embedding_scale  # [N, A*B, H]

    ctx_pos = torch.arange(length, device=device)
    context = drafter.context_kv(features, ctx_pos[None].expand(n, -1))
    block_of_query = torch.arange(count, device=device).repeat_interleave(block_size)  # [A*B]
    anchor_of_query = anchors[:, block_of_query]  # [N, A*B]
    sees_context = ctx_pos[None, None, :] < anchor_of_query[:, :, None]  # [N, A*B, L]
    sees_block = (block_of_query[:, None] == block_of_query[None, :]).expand(n, -1, -1)  # [N, A*B, A*B]
    allowed = torch.cat([sees_context, sees_block], dim=2)  # [N, A*B, L + A*B]
    key_pos = torch.cat([ctx_pos[None].expand(n, -1), block_pos], dim=1)  # [N, L + A*B]
    masks = [m[:, None] for m in drafter.layer_masks(allowed, block_pos[:, :, None], key_pos[:, None, :], windows)]

    def store(index: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx_keys, ctx_values = context[index]
        return torch.cat([ctx_keys, keys], dim=2), torch.cat([ctx_values, values], dim=2)

    hidden = drafter(embeds, block_pos, masks, store)  # [N, A*B, H]
    hidden = hidden.view(n, count, block_size, hidden.shape[-1])[:, :, 1:]  # [N, A, B-1, H]
    logits = head(hidden).float()  # [N, A, B-1, V]
    losses = F.cross_entropy(logits.flatten(0, 2), targets.flatten(), reduction="none").view_as(targets)
    weights = torch.tensor([math.exp(-k / gamma) for k in range(block_size - 1)], device=device)
    real = torch.ones_like(targets, dtype=torch.bool)
    if lengths is not None:  # slot k of a block holds position anchor + k + 1
        real = block_pos.view(n, count, block_size)[:, :, 1:] < lengths.to(device)[:, None, None]
    slot_weights = weights * real
    loss = (losses * slot_weights).sum() / slot_weights.sum().clamp_min(1e-9)
    correct = (logits.argmax(-1) == targets) & real  # [N, A, B-1]
    leading = correct.int().cumprod(dim=-1).sum(dim=-1)  # [N, A]
    return BlockStats(
        loss=loss,
        slot_accuracy=(correct.float().sum(dim=(0, 1)) / real.float().sum(dim=(0, 1)).clamp_min(1)).detach(),
        acceptance_length=1.0 + float(leading.float().mean()),
    )
