"""Training pieces of the DFlash drafter: anchor-sampled blocks, the block mask, the position-decayed loss.

One training example is a token sequence with the frozen verifier's features at every position. Blocks start at
sampled anchors a: the block input is `[x_a, MASK x (B-1)]` at positions a..a+B-1 and its targets are
x_{a+1}..x_{a+B-1}. A block sees the context of every position before its anchor and its own block (both ways),
never another block nor anything at or after its anchor: exactly what it sees when drafting after position a-1
was committed.
"""

from __future__ import annotations

import math

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


def sample_anchors(length: int, block_size: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """`count` distinct anchors in [1, length - block_size], sorted [count]."""
    choices = length - block_size
    if choices < count:
        raise ValueError(f"a sequence of {length} tokens holds fewer than {count} blocks of {block_size}")
    return torch.randperm(choices, generator=generator)[:count].sort().values + 1


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted cross-entropy of every block, and the per-slot accuracy [B-1].

    tokens [N, L]; features [N, L, F] (the verifier's, without grad); anchors [A] shared by the batch.
    Slot k of a block (k = 1..B-1) is weighted exp(-(k-1)/gamma).
    """
    n, length = tokens.shape
    device = tokens.device
    offsets = torch.arange(block_size, device=device)
    block_pos = (anchors[:, None].to(device) + offsets[None, :]).reshape(-1)  # [A*B]
    block_ids = tokens[:, block_pos].view(n, -1, block_size).clone()  # [N, A, B]
    targets = block_ids[:, :, 1:].clone()  # [N, A, B-1]
    block_ids[:, :, 1:] = mask_token_id
    embeds = F.embedding(block_ids.view(n, -1), embed) * embedding_scale  # [N, A*B, H]

    ctx_pos = torch.arange(length, device=device)
    context = drafter.context_kv(features, ctx_pos[None].expand(n, -1))
    block_of_query = torch.arange(anchors.numel(), device=device).repeat_interleave(block_size)  # [A*B]
    anchor_of_query = anchors.to(device)[block_of_query]
    sees_context = ctx_pos[None, :] < anchor_of_query[:, None]  # [A*B, L]
    sees_block = block_of_query[:, None] == block_of_query[None, :]  # [A*B, A*B]
    allowed = torch.cat([sees_context, sees_block], dim=1)  # [A*B, L + A*B]
    key_pos = torch.cat([ctx_pos, block_pos])
    masks = [mask[None, None] for mask in drafter.layer_masks(allowed, block_pos[:, None], key_pos[None, :])]

    def store(index: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx_keys, ctx_values = context[index]
        return torch.cat([ctx_keys, keys], dim=2), torch.cat([ctx_values, values], dim=2)

    hidden = drafter(embeds, block_pos[None].expand(n, -1), masks, store)  # [N, A*B, H]
    hidden = hidden.view(n, -1, block_size, hidden.shape[-1])[:, :, 1:]  # [N, A, B-1, H]
    logits = head(hidden).float()  # [N, A, B-1, V]
    losses = F.cross_entropy(logits.flatten(0, 2), targets.flatten(), reduction="none").view_as(targets)
    weights = torch.tensor([math.exp(-k / gamma) for k in range(block_size - 1)], device=device)
    loss = (losses * weights).sum(-1).mean() / weights.sum()
    accuracy = (logits.argmax(-1) == targets).float().mean(dim=(0, 1))  # [B-1]
    return loss, accuracy
