"""f_θ: a linear map from one layer's K/V of a position to another layer's, and its closed-form fit.

A layer's K/V of one position are laid out as one feature row: keys then values, each `[kv_heads, head_dim]`
flattened, so a map reads every head of the source and writes every head of the target.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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
class LinearProjection:
    """`target_row = source_row @ weight + bias`: `weight [in, out]`, `bias [out]`, float32."""

    weight: np.ndarray
    bias: np.ndarray

    def __post_init__(self) -> None:
        if self.weight.ndim != 2 or self.bias.shape != (self.weight.shape[1],):
            raise ValueError(f"a linear projection needs weight [in, out] and bias [out], got {self.weight.shape}")

    def apply(self, rows: np.ndarray) -> np.ndarray:
        """Map source rows `[P, in]` to target rows `[P, out]`."""
        if rows.shape[1] != self.weight.shape[0]:
            raise ValueError(f"the projection reads {self.weight.shape[0]} features per row, got {rows.shape[1]}")
        return (rows.astype(np.float32) @ self.weight + self.bias).astype(np.float32)

    @classmethod
    def fit(cls, source: np.ndarray, target: np.ndarray, *, ridge: float = 1e-3) -> LinearProjection:
        """Closed-form ridge least squares from source rows `[N, in]` to target rows `[N, out]`."""
        if source.shape[0] != target.shape[0]:
            raise ValueError(f"{source.shape[0]} source rows for {target.shape[0]} target rows")
        x = source.astype(np.float64)
        y = target.astype(np.float64)
        x_mean, y_mean = x.mean(axis=0), y.mean(axis=0)
        xc, yc = x - x_mean, y - y_mean
        # Ridge scaled by the mean feature variance, so one setting suits K/V of any magnitude.
        scale = float(np.mean(np.sum(xc * xc, axis=0))) or 1.0
        gram = xc.T @ xc + ridge * scale * np.eye(x.shape[1])
        weight = np.linalg.solve(gram, xc.T @ yc)
        bias = y_mean - x_mean @ weight
        return cls(weight.astype(np.float32), bias.astype(np.float32))
