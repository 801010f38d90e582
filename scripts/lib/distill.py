"""f_θ trained on what attention needs: attention-output distillation of a restoration plan's linear maps.

Closed-form least squares weighs every K/V value alike. What a restored position changes is the output of the
attention that reads it: a query's softmax over the resident keys and the restored ones, times their values. Here
each `projected` layer's map starts from its least-squares fit and is trained, by gradient descent on that layer
alone, so that the attention output of the training texts' queries, over their resident K/V (the first `sink`
positions and the `window` before the query, exact) and the restored K/V of the positions evicted before them
(the map's), matches the output over the exact K/V. The queries come from a forward of the verifier's own
transformers model, captured as its attention reads them (after the rotary, with the model's scaling).

Each layer is trained with every other layer exact (the queries are `full`'s), so the errors of several layers
still add up as they do for least squares; what changes is what each map spends its capacity on.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from kv_cache_proposer.restoration import LinearProjection, RestorationPlan
from kv_cache_proposer.restoration.projection import unrotated_rows
from lib.restoration import DRAFTER_ROWS, POSITIONS

_CAPTURE = "kakeya_query_capture"


@dataclass(frozen=True, slots=True)
class Queries:
    """Every layer's queries of some texts as attention reads them: `[texts, Hq, length, D]` per layer, and the
    scaling of its scores."""

    by_layer: dict[int, np.ndarray]
    scaling: dict[int, float]


def collect_queries(verifier: Any, texts: Sequence[list[int]], layers: Sequence[int]) -> Queries:
    """The queries of `layers` for each of `texts` (of one length), from a forward of the verifier's transformers
    model whose attention records them."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    wanted = set(layers)
    seen: dict[int, list[np.ndarray]] = {layer: [] for layer in layers}
    scaling: dict[int, float] = {}

    def capture(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, **kw: Any) -> Any:
        if module.layer_idx in wanted:
            seen[module.layer_idx].append(query[0].detach().float().cpu().numpy())
            scaling[module.layer_idx] = float(kw.get("scaling") or query.shape[-1] ** -0.5)
        return sdpa_attention_forward(module, query, key, value, mask, **kw)

    AttentionInterface.register(_CAPTURE, capture)
    model = verifier.model
    before = model.config._attn_implementation
    model.config._attn_implementation = _CAPTURE
    try:
        with torch.inference_mode():
            for tokens in tqdm(texts, desc="collect queries", unit="text", file=sys.stderr, leave=False):
                model(input_ids=torch.tensor([tokens], device=verifier.device), use_cache=False)
    finally:
        model.config._attn_implementation = before
    return Queries({layer: np.stack(rows) for layer, rows in seen.items()}, scaling)


@dataclass(frozen=True, slots=True)
class DistillSettings:
    """What the maps are trained for (`sink` + `window` resident) and how."""

    sink: int
    window: int
    steps: int = 300
    lr: float = 1e-2
    queries_per_step: int = 256
    seed: int = 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DistillSettings:
        """The settings `add_distill_options` and a script's `--sink` / `--window` name."""
        return cls(args.sink, args.window, steps=args.distill_steps, lr=args.distill_lr)

    def describe(self) -> str:
        """How the maps were trained, for a plan's notes."""
        steps = f"{self.steps} steps of attention-output distillation"
        return f"{steps} (lr {self.lr}, sink {self.sink} + window {self.window})"


def distill_projections(
    plan: RestorationPlan,
    rows: dict[int, np.ndarray],
    queries: Queries,
    settings: DistillSettings,
) -> tuple[RestorationPlan, dict[str, dict[str, float]]]:
    """Train every `projected` layer's map of `plan` (fitted already: its least-squares start) on the attention
    output of its layer; the last text of `rows` is held out. Returns the plan with the trained maps (a map that
    does not do better on the held-out text than its start keeps its start) and, per map, the held-out relative
    error of the attention output before and after."""
    positions = rows[POSITIONS]
    starts = np.flatnonzero(positions == 0)
    length = int(np.diff(np.append(starts, len(positions))).max())
    if not (np.diff(np.append(starts, len(positions))) == length).all() or len(starts) < 2:
        raise ValueError("distillation needs at least two texts of one length (the last is held out)")
    trained, report = {}, {}
    for index, source in enumerate(plan.layers):
        projection = source.projection
        if projection is None or (source.from_layer is None and not source.from_drafter):
            continue
        x = rows[DRAFTER_ROWS if source.from_drafter else source.from_layer]  # type: ignore[index]
        layer = _Layer(
            x.reshape(-1, length, x.shape[1]),
            rows[index].reshape(-1, length, rows[index].shape[1]),
            queries.by_layer[index],
            queries.scaling[index],
            positions[:length],
        )
        name = f"{'drafter' if source.from_drafter else f'L{source.from_layer}'}->L{index}"
        trained[index], report[name] = _distill(projection, layer, settings, name)
    return plan.with_projections(trained), report


@dataclass(frozen=True, slots=True)
class _Layer:
    """One layer's training data, by text: source rows `[T, L, in]`, target K/V rows `[T, L, 2·Hkv·D]`, queries
    `[T, Hq, L, D]`, the scaling of their scores, and the positions `[L]` of a text."""

    source: np.ndarray
    target: np.ndarray
    queries: np.ndarray
    scaling: float
    positions: np.ndarray

    @property
    def length(self) -> int:
        return int(self.positions.size)


def _turn(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Keys `[Hkv, L, D]` turned by the per-position `cos`, `sin` `[L, D/2]` (rotate-half layout)."""
    half = keys.shape[-1] // 2
    first, second = keys[..., :half], keys[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def _heads(rows: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V rows `[L, 2·H·D]` as keys and values `[H, L, D]`."""
    count, width = rows.shape
    dim = width // (2 * heads)
    keys = rows[:, : width // 2].reshape(count, heads, dim).transpose(0, 1)
    values = rows[:, width // 2 :].reshape(count, heads, dim).transpose(0, 1)
    return keys, values


def _distill(
    start: LinearProjection, layer: _Layer, settings: DistillSettings, name: str
) -> tuple[LinearProjection, dict[str, float]]:
    rotary = start.rotary
    source = layer.source
    if rotary is not None and start.reads_keys:
        source = np.stack([unrotated_rows(text, layer.positions, rotary) for text in source])
    q_heads, kv_heads = layer.queries.shape[1], layer.target.shape[2] // (2 * layer.queries.shape[3])
    group = q_heads // kv_heads
    cos = sin = torch.zeros(0)
    if rotary is not None:
        angles = torch.from_numpy(layer.positions[:, None] * rotary.inv_freq.astype(np.float64)[None])
        cos, sin = (torch.cos(angles) * rotary.scale).float(), (torch.sin(angles) * rotary.scale).float()
    weight = torch.tensor(start.weight, requires_grad=True)
    bias = torch.tensor(start.bias, requires_grad=True)
    first_query = settings.sink + settings.window + 1  # the first position with an evicted key before it
    if first_query >= layer.length:
        raise ValueError(f"texts of {layer.length} tokens evict nothing under sink {settings.sink} + {settings.window}")

    def output_error(i: int, picked: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The relative error of text i's attention output at the `picked` query positions, the map being `w`, `b`."""
        x, q = torch.from_numpy(source[i]), torch.from_numpy(layer.queries[i])
        keys, values = _heads(torch.from_numpy(layer.target[i]), kv_heads)
        predicted_keys, predicted_values = _heads(x @ w + b, kv_heads)
        if rotary is not None:
            predicted_keys = _turn(predicted_keys, cos, sin)
        q = q[:, picked]  # [Hq, m, D]
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
        predicted_keys = predicted_keys.repeat_interleave(group, 0)
        predicted_values = predicted_values.repeat_interleave(group, 0)
        key_positions = torch.arange(layer.length)[None]
        causal = key_positions <= picked[:, None]  # [m, L]
        evicted = (key_positions >= settings.sink) & (key_positions < picked[:, None] - settings.window)
        exact_scores = (q @ keys.transpose(1, 2) * layer.scaling).masked_fill(~causal, float("-inf"))
        with torch.no_grad():
            reference = torch.softmax(exact_scores, -1) @ values
        scores = torch.where(evicted, q @ predicted_keys.transpose(1, 2) * layer.scaling, exact_scores)
        weights = torch.softmax(scores, -1)
        out = (weights * ~evicted) @ values + (weights * evicted) @ predicted_values
        spread = float(((reference - reference.mean(dim=(1, 2), keepdim=True)) ** 2).sum())
        return ((out - reference) ** 2).sum() / max(spread, 1e-12)

    held = len(source) - 1
    everything = torch.arange(first_query, layer.length)

    def held_error(w: torch.Tensor, b: torch.Tensor) -> float:
        with torch.no_grad():
            return float(output_error(held, everything, w, b))

    before = held_error(weight.detach(), bias.detach())
    # The size of a weight that carries the source's spread to the target's: what the step size is relative to.
    scale = float(layer.target.std()) / (float(source.std()) * np.sqrt(source.shape[-1]) or 1.0)
    optimizer = torch.optim.Adam([weight, bias], lr=settings.lr * scale)
    generator = torch.Generator().manual_seed(settings.seed)
    for _ in tqdm(range(settings.steps), desc=f"distil {name}", unit="step", file=sys.stderr, leave=False):
        i = int(torch.randint(held, (1,), generator=generator))
        count = min(settings.queries_per_step, len(everything))
        picked = everything[torch.randperm(len(everything), generator=generator)[:count]]
        loss = output_error(i, picked, weight, bias)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = held_error(weight.detach(), bias.detach())
    report = {"least_squares": before, "distilled": after}
    if after >= before:
        return start, report
    learned = weight.detach().numpy().astype(np.float32), bias.detach().numpy().astype(np.float32)
    return LinearProjection(*learned, rotary, start.reads_keys), report


def add_distill_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--distill-steps",
        type=int,
        default=0,
        help="train each map further on its layer's attention output for this many steps (default 0: least "
        "squares only)",
    )
    parser.add_argument(
        "--distill-lr",
        type=float,
        default=1e-2,
        help="distillation step size, relative to the size of a weight that carries the source rows' spread to the "
        "target rows' (default 1e-2)",
    )


def distill_plan(
    verifier: Any,
    plan: RestorationPlan,
    rows: dict[int, np.ndarray],
    texts: Sequence[list[int]],
    settings: DistillSettings,
) -> tuple[RestorationPlan, dict[str, dict[str, float]]]:
    """`distill_projections` of `plan`, with the queries of its projected layers collected from `texts` (the texts
    `rows` were collected from)."""
    projected = [i for i, source in enumerate(plan.layers) if source.projection is not None]
    return distill_projections(plan, rows, collect_queries(verifier, texts, projected), settings)
