"""The DFlash drafter's per-position context state, as a source of f_θ.

A DFlash drafter conditions on the verifier's hidden states at `target_layer_ids` (outputs of those decoder layers),
concatenated and projected by its `fc` then `hidden_norm`: one `hidden`-wide vector per committed position, the
state the drafter turns into its context K/V. A restoration plan can read f_θ from it (`projected` from
`drafter_context`); the plan carries the drafter's `fc` and `hidden_norm` weights so that the session computes the
same vector on the host from the features its verifier forwards return.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kv_cache_proposer.restoration.projection import row_product


@dataclass(frozen=True, slots=True, eq=False)
class DrafterContext:
    """`hidden_norm(fc(concat(verifier outputs at target_layer_ids)))`: `fc_weight [H, L*H]`, `norm_weight [H]`."""

    target_layer_ids: tuple[int, ...]
    fc_weight: np.ndarray
    norm_weight: np.ndarray
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if not self.target_layer_ids:
            raise ValueError("a drafter context reads at least one verifier layer")
        if self.fc_weight.ndim != 2 or self.norm_weight.shape != (self.fc_weight.shape[0],):
            raise ValueError(
                f"a drafter context needs fc [H, L*H] and hidden_norm [H], got {self.fc_weight.shape} and "
                f"{self.norm_weight.shape}"
            )
        if self.fc_weight.shape[1] % len(self.target_layer_ids):
            raise ValueError(f"fc reads {self.fc_weight.shape[1]} features, not a multiple of the target layers")

    @property
    def width(self) -> int:
        """Values per position."""
        return int(self.fc_weight.shape[0])

    def apply(self, features: np.ndarray) -> np.ndarray:
        """Context rows `[n, H]` (float32) of verifier features `[n, L*H]` (outputs of `target_layer_ids`)."""
        if features.shape[1] != self.fc_weight.shape[1]:
            raise ValueError(f"the drafter context reads {self.fc_weight.shape[1]} features, got {features.shape[1]}")
        projected = row_product(features, self.fc_weight.T)  # [n, H]
        scale = 1.0 / np.sqrt(np.mean(projected * projected, axis=-1, keepdims=True) + self.eps)  # RMSNorm
        return (projected * scale * self.norm_weight).astype(np.float32)

    @classmethod
    def from_drafter(cls, directory: str | Path) -> DrafterContext:
        """The context of the DFlash drafter checkpoint in `directory` (its `config.json` and weights)."""
        from safetensors.torch import load_file

        from kv_cache_proposer.proposers.dflash.config import read_config

        path = Path(directory)
        raw, spec = read_config(path)
        tensors = {}
        for file in sorted(path.glob("*.safetensors")):
            tensors.update(load_file(file))
        try:
            fc, norm = tensors["fc.weight"], tensors["hidden_norm.weight"]
        except KeyError as exc:
            raise ValueError(f"{path}: the drafter weights lack {exc.args[0]}") from None
        return cls(
            spec.target_layer_ids,
            fc.float().numpy(),
            norm.float().numpy(),
            float(raw.get("rms_norm_eps", 1e-6)),
        )


class ContextStore:
    """A session's drafter context rows of its committed positions from `first` on (the positions that can be
    evicted), on the host, plus those of the forward in flight until its commit accepts them."""

    def __init__(self, context: DrafterContext, first: int) -> None:
        self._context = context
        self._first = first
        self._rows = np.zeros((0, context.width), dtype=np.float32)  # [capacity, H]
        self._count = 0  # committed positions held: [first, first + count)
        self._stage = np.zeros((0, context.width), dtype=np.float32)  # [staged, H]
        self._staged_filled = 0  # stage rows written, from the start of the stage

    @property
    def count(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        return int(self._rows.nbytes + self._stage.nbytes)

    def begin_stage(self, block_len: int, *, extend: bool) -> None:
        kept = self._stage[: self._staged_filled] if extend else self._stage[:0]
        self._stage = np.concatenate([kept, np.zeros((block_len, self._context.width), dtype=np.float32)])

    def stage_features(self, start: int, features: np.ndarray) -> None:
        """The verifier features `[n, L*H]` of stage positions `[start, start + n)`."""
        rows = self._context.apply(features)
        self._stage[start : start + rows.shape[0]] = rows
        self._staged_filled = max(self._staged_filled, start + rows.shape[0])

    def commit(self, next_position: int, count: int) -> None:
        """Keep the rows of the first `count` staged positions, which sit at `next_position, ...`; raises
        `ValueError` when the forward handed no features for them."""
        keep = max(0, next_position + count - max(next_position, self._first))  # positions from `first` on
        if count and self._staged_filled < count:
            raise ValueError(f"the forward handed drafter features for {self._staged_filled} of {count} positions")
        if keep:
            needed = self._count + keep
            if needed > self._rows.shape[0]:
                grown = np.zeros((max(needed, self._rows.shape[0] * 3 // 2 + 256), self._context.width), np.float32)
                grown[: self._count] = self._rows[: self._count]
                self._rows = grown
            self._rows[self._count : needed] = self._stage[count - keep : count]
            self._count = needed
        self._stage = self._stage[:0]
        self._staged_filled = 0

    def rows(self, start: int, end: int) -> np.ndarray:
        """Context rows `[end - start, H]` of committed positions `[start, end)`."""
        if start < self._first or end > self._first + self._count:
            raise ValueError(f"no drafter context for positions [{start}, {end})")
        return self._rows[start - self._first : end - self._first]

    def trim(self) -> None:
        """Drop the growth room: hold exactly the committed rows."""
        self._rows = self._rows[: self._count].copy()
        self._stage = self._stage[:0]

    def clone(self, length: int) -> ContextStore:
        """A copy holding the rows of positions before `length`."""
        twin = ContextStore(self._context, self._first)
        twin._count = max(0, min(self._count, length - self._first))
        twin._rows = self._rows[: twin._count].copy()
        return twin
