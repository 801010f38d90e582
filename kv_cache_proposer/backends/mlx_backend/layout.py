"""Weights laid out for MLX's matrix products on a CPU.

mlx-lm's `nn.Linear` keeps its weight as stored, `[out, in]`, and multiplies by the transposed view; a tied LM
head does the same with the embedding table. MLX's CPU backend hands that view to BLAS as a transposed operand,
which the reference BLAS that MLX's Linux CPU wheels link reads about half as fast as the same weight stored
`[in, out]`: on the bundled model's shapes (one row to 512) `x @ w_t` takes 0.26–0.74 of the time of `x @ w.T`,
about half in most. On a CPU the verifier therefore keeps every plain linear layer and token embedding
input-major: the same values, transposed once at load and the original freed, so the model holds no more memory
than before. Metal is left as mlx-lm lays it out."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn


class InputMajorLinear(nn.Module):
    """`nn.Linear` with its weight stored `[in, out]`: `x @ weight_t (+ bias)`."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight_t = mx.contiguous(linear.weight.T)
        if "bias" in linear:
            self.bias = linear.bias

    @property
    def weight(self) -> mx.array:
        """The weight as `nn.Linear` holds it, `[out, in]` (a view), for model code that reads it."""
        return self.weight_t.T

    def __call__(self, x: mx.array) -> mx.array:
        if "bias" in self:
            return mx.addmm(self["bias"], x, self.weight_t)
        return x @ self.weight_t


class InputMajorEmbedding(nn.Module):
    """`nn.Embedding` with its table stored `[dims, vocab]`: lookups read columns, `as_linear` (a tied LM head)
    multiplies by the table as stored."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.weight_t = mx.contiguous(embedding.weight.T)

    @property
    def weight(self) -> mx.array:
        """The table as `nn.Embedding` holds it, `[vocab, dims]` (a view)."""
        return self.weight_t.T

    def __call__(self, token_ids: mx.array) -> mx.array:
        return self.weight_t.T[token_ids]

    def as_linear(self, x: mx.array) -> mx.array:
        return x @ self.weight_t


def input_major(model: nn.Module) -> int:
    """Replace the plain `nn.Linear` and `nn.Embedding` modules of `model` (not subclasses such as quantized
    layers) by their input-major forms, one at a time so the model never holds two copies; returns how many."""
    replaced = 0
    parents = [module for _, module in model.named_modules() if module.children()]  # holds no replaced module
    for module in parents:
        for name in list(module.children()):  # names only: `children` holds copies of the lists
            child = module[name]
            if isinstance(child, list):
                for index, item in enumerate(child):
                    new = _input_major(item)
                    if new is not None:
                        child[index] = new
                        replaced += 1
            else:
                new = _input_major(child)
                if new is not None:
                    setattr(module, name, new)
                    replaced += 1
    return replaced


def _input_major(module: Any) -> nn.Module | None:
    if type(module) is nn.Linear:
        new: nn.Module = InputMajorLinear(module)
    elif type(module) is nn.Embedding:
        new = InputMajorEmbedding(module)
    else:
        return None
    mx.eval(new.parameters())
    return new
