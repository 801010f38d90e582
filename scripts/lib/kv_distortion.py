"""How the KV quality bench scores a K/V format: summed NLL and KL per window, perplexity change and mean KL per
text kind, and each KakeyaLattice point judged against the field's rate-distortion curve."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch


def nll_and_kl(reference: torch.Tensor, measured: torch.Tensor, targets: torch.Tensor) -> tuple[float, float]:
    """Summed negative log-likelihood of `targets` under `measured`, and summed KL(reference ‖ measured)."""
    nll = -measured.gather(-1, targets[:, None]).sum()
    kl = torch.zeros(())
    for start in range(0, reference.shape[0], 1024):
        r, m = reference[start : start + 1024], measured[start : start + 1024]
        kl += (r.exp() * (r - m)).sum()
    return float(nll), float(kl)


def distortion(kinds: dict[str, dict[str, Any]], reference: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Per text kind the perplexity, its change against `reference`'s (%) and the mean KL, from the summed NLL,
    KL and token counts of each kind; then the mean and worst change and the mean KL over the kinds."""
    row: dict[str, float] = {}
    deltas, kls = [], []
    for kind, entry in kinds.items():
        ppl, base = (math.exp(e["nll"] / e["tokens"]) for e in (entry, reference[kind]))
        deltas.append(100 * (ppl / base - 1))
        kls.append(entry["kl"] / entry["tokens"])
        row.update({f"ppl[{kind}]": ppl, f"dppl_pct[{kind}]": deltas[-1], f"kl[{kind}]": kls[-1]})
    row.update(dppl_pct_mean=float(np.mean(deltas)), dppl_pct_max=float(np.max(deltas)), kl_mean=float(np.mean(kls)))
    return row


def frontier(points: list[tuple[float, float]], bits: float) -> float | None:
    """The field's curve (lowest Δ at or below each rate, linear between points) at `bits`, or None outside it."""
    points = sorted(points)
    if not points or not points[0][0] <= bits <= points[-1][0]:
        return None
    best: list[tuple[float, float]] = []
    for b, d in points:  # the lower envelope: a point counts only if no cheaper point is better
        if not best or d < best[-1][1]:
            best.append((b, d))
    xs, ys = [b for b, _ in best], [d for _, d in best]
    if bits > xs[-1]:
        return ys[-1]
    return float(np.interp(bits, xs, ys))


def verdicts(rows: dict[str, dict[str, Any]]) -> list[str]:
    """Plain sentences: each KakeyaLattice point against the field's curve at its rate (Δ perplexity and KL)."""
    field = {k: v for k, v in rows.items() if v["family"].startswith("field") and v["bits_per_value"]}
    lines = []
    for name, row in rows.items():
        if row["family"] != "kakeya" or row["bits_per_value"] is None:
            continue
        for key, label in (("dppl_pct_mean", "Δ perplexity"), ("kl_mean", "KL")):
            curve = frontier([(v["bits_per_value"], v[key]) for v in field.values()], row["bits_per_value"])
            if curve is None:
                lines.append(f"{name}: {row['bits_per_value']:.2f} bits/value is outside the field's range")
                break
            verdict = "at or below" if row[key] <= curve else "above"
            lines.append(
                f"{name} ({row['bits_per_value']:.2f} bits/value): {label} {row[key]:.4g} is {verdict} the "
                f"field's curve ({curve:.4g})"
            )
    return lines
