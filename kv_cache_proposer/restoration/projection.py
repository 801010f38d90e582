"""f_θ: a linear map from one layer's K/V of a position to another layer's, and its closed-form fit.

A layer's K/V of one position are laid out as one feature row: keys then values, each `[kv_heads, head_dim]`
flattened, so a map reads every head of the source and writes every head of the target.

A verifier with rotary position embeddings stores a key already turned by an angle of its position, which a row
without a position (the drafter's context) cannot predict linearly, and which a map between layers must undo and
redo. A map may therefore work in the keys' unrotated frame (`Rotary`): the source keys are turned back before it
and the keys it writes are turned to their positions after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def row_product(rows: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """`rows [P, in] @ weight [in, out]` in float32, each row's values independent of the other rows.

    Each row is a product of its own (one matrix-vector product of one shape per row, `[P, 1, in] @ weight`).
    numpy's BLAS picks its kernel by a product's shape and, within a kernel over several rows, may sum a row in an
    order that depends on where it sits among them (on an AVX2 CPU OpenBLAS sums rows 0-5, 6-11 and 12-15 of a
    16-row product three ways), so a position's restored K/V (or drafter context row) would depend on how many
    positions its forward evicted with it or a rebuild mapped at once (`test_projection.py`). Rows one by one cost
    1.4-3x one product of every row on the shapes of the default model's maps; the maps run on a forward's evicted
    positions, a few at a time."""
    count, width = rows.shape
    stacked = np.ascontiguousarray(rows, dtype=np.float32).reshape(count, 1, width)
    return (stacked @ weight).reshape(count, weight.shape[1])


def kv_rows(keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """K/V `[B, H, P, D]` (B = 1) as feature rows `[P, 2 * H * D]`."""
    k = np.transpose(keys[0], (1, 0, 2)).reshape(keys.shape[2], -1)  # [P, H*D]
    v = np.transpose(values[0], (1, 0, 2)).reshape(values.shape[2], -1)  # [P, H*D]
    return np.concatenate([k, v], axis=1)


def rows_kv(rows: np.ndarray, heads: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Feature rows `[P, 2 * H * D]` back to K/V `[1, H, P, D]`."""
    count = rows.shape[0]
    half = heads * head_dim
    keys = rows[:, :half].reshape(count, heads, head_dim).transpose(1, 0, 2)[None]
    values = rows[:, half:].reshape(count, heads, head_dim).transpose(1, 0, 2)[None]
    return np.ascontiguousarray(keys), np.ascontiguousarray(values)


@dataclass(frozen=True, slots=True, eq=False)
class Rotary:
    """A verifier's rotary position embedding of keys, in the rotate-half layout: the key `k` of a position p is
    stored as `scale · (k·cos(p·f) + rotate_half(k)·sin(p·f))` with `f = inv_freq` (`[head_dim / 2]`) repeated
    over both halves of the head."""

    inv_freq: np.ndarray
    scale: float = 1.0

    def __post_init__(self) -> None:
        if self.inv_freq.ndim != 1 or self.inv_freq.size == 0 or not self.scale > 0:
            raise ValueError(f"a rotary needs inv_freq [head_dim / 2] and a positive scale, got {self.inv_freq.shape}")

    @property
    def head_dim(self) -> int:
        return 2 * int(self.inv_freq.size)

    def turn(self, keys: np.ndarray, positions: np.ndarray, *, back: bool = False) -> np.ndarray:
        """Keys `[P, H * head_dim]` (a row's key half) turned to their `positions` `[P]` (`back`: turned back to
        the unrotated frame, as the verifier computed them before its rotary)."""
        count, width = keys.shape
        if width % self.head_dim or positions.shape != (count,):
            raise ValueError(f"cannot turn keys {keys.shape} (heads of {self.head_dim}) at positions {positions.shape}")
        angles = positions.astype(np.float64)[:, None, None] * self.inv_freq.astype(np.float64)  # [P, 1, D/2]
        cos, sin = np.cos(angles), np.sin(angles)
        heads = keys.reshape(count, width // self.head_dim, self.head_dim).astype(np.float64)
        first, second = heads[..., : self.head_dim // 2], heads[..., self.head_dim // 2 :]
        if back:
            turned = np.concatenate([first * cos + second * sin, second * cos - first * sin], axis=-1) / self.scale
        else:
            turned = np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1) * self.scale
        return turned.reshape(count, width).astype(np.float32)

    def same_as(self, other: Rotary) -> bool:
        return self.scale == other.scale and np.array_equal(self.inv_freq, other.inv_freq)


@dataclass(frozen=True, slots=True, eq=False)
class LinearProjection:
    """`target_row = source_row @ weight + bias`: `weight [in, out]`, `bias [out]`, float32. With `rotary`, the map
    works in the keys' unrotated frame: the key half of its output is turned to the rows' positions after it, and,
    when `reads_keys` (its source is a layer's K/V row), the key half of its input is turned back before it."""

    weight: np.ndarray
    bias: np.ndarray
    rotary: Rotary | None = None
    reads_keys: bool = False

    def __post_init__(self) -> None:
        if self.weight.ndim != 2 or self.bias.shape != (self.weight.shape[1],):
            raise ValueError(f"a linear projection needs weight [in, out] and bias [out], got {self.weight.shape}")
        if self.rotary is not None:
            halves = (self.weight.shape[1], *((self.weight.shape[0],) if self.reads_keys else ()))
            if any(width % (2 * self.rotary.head_dim) for width in halves):
                raise ValueError(
                    f"a projection of rows {self.weight.shape} cannot turn keys of head size {self.rotary.head_dim}"
                )

    def apply(self, rows: np.ndarray, positions: np.ndarray | None = None) -> np.ndarray:
        """Map source rows `[P, in]` to target rows `[P, out]`; `positions` `[P]`: the rows' positions, which a map
        in the unrotated frame needs."""
        if rows.shape[1] != self.weight.shape[0]:
            raise ValueError(f"the projection reads {self.weight.shape[0]} features per row, got {rows.shape[1]}")
        rotary = self.rotary
        if rotary is None:
            return (row_product(rows, self.weight) + self.bias).astype(np.float32)
        if positions is None:
            raise ValueError("a projection in the keys' unrotated frame needs the rows' positions")
        source = rows.astype(np.float32)
        if self.reads_keys:
            source = unrotated_rows(source, positions, rotary)
        out = (row_product(source, self.weight) + self.bias).astype(np.float32)
        half = out.shape[1] // 2
        out[:, :half] = rotary.turn(out[:, :half], positions)
        return out

    @classmethod
    def fit(
        cls,
        source: np.ndarray,
        target: np.ndarray,
        *,
        ridge: float = 1e-3,
        rotary: Rotary | None = None,
        positions: np.ndarray | None = None,
        reads_keys: bool = False,
    ) -> LinearProjection:
        """Closed-form ridge least squares from source rows `[N, in]` to target K/V rows `[N, out]`, as stored;
        with `rotary` (and the rows' `positions`), in the keys' unrotated frame (`reads_keys`: the source rows are
        K/V rows too)."""
        if source.shape[0] != target.shape[0]:
            raise ValueError(f"{source.shape[0]} source rows for {target.shape[0]} target rows")
        if rotary is not None:
            if positions is None:
                raise ValueError("a fit in the keys' unrotated frame needs the rows' positions")
            if reads_keys:
                source = unrotated_rows(source.astype(np.float32), positions, rotary)
            target = unrotated_rows(target.astype(np.float32), positions, rotary)
        x = source.astype(np.float64)
        y = target.astype(np.float64)
        x_mean, y_mean = x.mean(axis=0), y.mean(axis=0)
        xc, yc = x - x_mean, y - y_mean
        # Ridge scaled by the mean feature variance, so one setting suits K/V of any magnitude.
        scale = float(np.mean(np.sum(xc * xc, axis=0))) or 1.0
        gram = xc.T @ xc + ridge * scale * np.eye(x.shape[1])
        weight = np.linalg.solve(gram, xc.T @ yc)
        bias = y_mean - x_mean @ weight
        return cls(weight.astype(np.float32), bias.astype(np.float32), rotary, reads_keys and rotary is not None)


def unrotated_rows(rows: np.ndarray, positions: np.ndarray, rotary: Rotary) -> np.ndarray:
    """K/V rows `[P, 2 * H * D]` with their key half turned back to the unrotated frame."""
    out = rows.copy()
    half = rows.shape[1] // 2
    out[:, :half] = rotary.turn(rows[:, :half], positions, back=True)
    return out
