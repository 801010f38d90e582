"""The direct forward's compute between attentions, run one of two ways.

Between two layers' attentions a decoder runs the earlier layer's output projection, residual, norm and SiLU MLP,
then the next layer's input norm, Q/K/V projections, Q/K norms and rotary embedding; before the first attention only
the latter, after the last only the former and the final norm. `ScriptedSteps` runs these as TorchScript functions,
two per layer, with the kernels of transformers' modules in their order (the same values bit for bit), except
where int4 layers over quantized rows compute the norm before them themselves (`normed_products`).
`CompiledSteps` runs each span as one graph compiled by `torch.compile` (inductor: C++ on a CPU, Triton on CUDA),
which fuses the element-wise work around the matrix products and calls the graph once per layer. Neither touches
the K/V staging, the masks or the attention, so every cache strategy runs either way. A compiled graph depends on
the block's query count, not on its keys: one graph serves a single query and one, with the count symbolic, every
larger block, whatever the history.

Compiled graphs are cached on disk by inductor, in `$TORCHINDUCTOR_CACHE_DIR` (default
`$XDG_CACHE_HOME/kakeya/inductor`, else `~/.cache/kakeya/inductor`), so a later start loads them instead of
compiling.
"""

from __future__ import annotations

import os
import warnings
from functools import cache
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from kv_cache_proposer.backends.torch_backend.weights import linear, qrows_linear

# A linear layer as `weights.linear` takes it: (weight, bias, qparams, kind, group).
Linear = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, int, int]
# The arguments of `attention_inputs` after the hidden states, less cos/sin/head_dim: (norm, eps, projections,
# sizes, q_norm, k_norm, head_eps). `projections` is [wq, wk, wv], or one product of the three weights stacked
# (`weights.stack_int4`) whose output `sizes` [q, k, v] splits.
Inputs = tuple[torch.Tensor, float, list[Linear], list[int], torch.Tensor | None, torch.Tensor | None, float]
# The arguments of `layer_output` after the hidden states and attention's output, less head_dim: (wo, norm, eps,
# gate_up, w_down). `gate_up` is [w_gate, w_up], or one product of the two stacked whose output halves are theirs.
Output = tuple[Linear, torch.Tensor, float, list[Linear], Linear]
# The final norm: (weight, eps).
Norm = tuple[torch.Tensor, float]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(dtype)


def normed_products(
    hidden: torch.Tensor, norm: torch.Tensor, eps: float, projections: list[Linear]
) -> list[torch.Tensor]:
    """The products of `projections` over `hidden` [B, n, H] under the RMS norm (weight `norm`, `eps`), each [B, n,
    out]. Products held for the kernel's quantized rows (`weights.INT4_QROWS`: a CPU with AVX2)
    compute the norm themselves as they read the rows, in the kernel's own order (`weights.qrows_linear`): one call
    where the norm takes seven, the same values stacked or not (unstacked, each product normalises the rows again),
    and a row's values still do not depend on the rows beside it."""
    if all(w[3] == 7 for w in projections):  # weights.INT4_QROWS
        outputs: list[torch.Tensor] = []
        for w in projections:
            qparams = w[2]
            assert qparams is not None
            outputs.append(qrows_linear(hidden, w[0], w[1], qparams, norm, eps))
        return outputs
    x = rms_norm(hidden, norm, eps)
    return [linear(x, w[0], w[1], w[2], w[3], w[4]) for w in projections]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attention_inputs(
    hidden: torch.Tensor,
    norm: torch.Tensor,
    eps: float,
    projections: list[Linear],
    sizes: list[int],
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    head_eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim: int,
) -> list[torch.Tensor]:
    """A layer's Q, K and V [B, heads, n, D] from its input [B, n, H]: input norm, projections, the Q/K norms
    where the model has them (Qwen3), rotary embedding."""
    batch, n = hidden.shape[0], hidden.shape[1]
    outputs = normed_products(hidden, norm, eps, projections)
    if len(outputs) == 1:
        outputs = list(outputs[0].split(sizes, dim=-1))
    q = outputs[0].view(batch, n, -1, head_dim)
    k = outputs[1].view(batch, n, -1, head_dim)
    v = outputs[2].view(batch, n, -1, head_dim).transpose(1, 2)
    if q_norm is not None:
        q = rms_norm(q, q_norm, head_eps)
    if k_norm is not None:
        k = rms_norm(k, k_norm, head_eps)
    q = q.transpose(1, 2)
    k = k.transpose(1, 2)
    q = (q * cos) + (rotate_half(q) * sin)
    k = (k * cos) + (rotate_half(k) * sin)
    return [q, k, v]


def layer_output(
    hidden: torch.Tensor,
    attended: torch.Tensor,
    wo: Linear,
    norm: torch.Tensor,
    eps: float,
    gate_up: list[Linear],
    w_down: Linear,
    head_dim: int,
) -> torch.Tensor:
    """The layer's output [B, n, H] from its input and attention's output: output projection, residual, norm,
    SiLU-gated MLP, residual."""
    batch, n = hidden.shape[0], hidden.shape[1]
    attended = attended.reshape(batch, -1, n, head_dim).transpose(1, 2).contiguous()
    hidden = hidden + linear(attended.reshape(batch, n, -1).contiguous(), wo[0], wo[1], wo[2], wo[3], wo[4])
    outputs = normed_products(hidden, norm, eps, gate_up)
    if len(outputs) == 1:
        outputs = list(outputs[0].chunk(2, dim=-1))
    x = linear(F.silu(outputs[0]) * outputs[1], w_down[0], w_down[1], w_down[2], w_down[3], w_down[4])
    return hidden + x


class LayerSteps(Protocol):
    """How the direct forward runs the compute between attentions (module docstring)."""

    def first(
        self, hidden: torch.Tensor, inputs: Inputs, head_dim: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> list[torch.Tensor]:
        """The first layer's Q, K, V [B, heads, n, D] from the embeddings [B, n, H]."""
        ...

    def between(
        self,
        hidden: torch.Tensor,
        attended: torch.Tensor,
        output: Output,
        head_dim: int,
        inputs: Inputs,
        next_head_dim: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A layer's output [B, n, H] from its input and attention's output, and the next layer's Q, K, V."""
        ...

    def last(
        self, hidden: torch.Tensor, attended: torch.Tensor, output: Output, head_dim: int, norm: Norm
    ) -> torch.Tensor:
        """The last layer's output [B, n, H] under the final norm (`norm`: its weight and epsilon)."""
        ...


@cache
def _scripted() -> tuple[Any, Any, Any]:
    """The layer halves and the norm compiled once per process (`torch.jit.script` warns that it is deprecated;
    it still runs a small op graph without Python between the ops, with the same kernels)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.script(attention_inputs), torch.jit.script(layer_output), torch.jit.script(rms_norm)


class ScriptedSteps:
    """The spans as TorchScript functions: transformers' kernels in their order, two calls per layer."""

    def __init__(self) -> None:
        self._inputs, self._output, self._norm = _scripted()

    def first(
        self, hidden: torch.Tensor, inputs: Inputs, head_dim: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> list[torch.Tensor]:
        return self._inputs(hidden, *inputs, cos, sin, head_dim)

    def between(
        self,
        hidden: torch.Tensor,
        attended: torch.Tensor,
        output: Output,
        head_dim: int,
        inputs: Inputs,
        next_head_dim: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        hidden = self._output(hidden, attended, *output, head_dim)
        return hidden, self._inputs(hidden, *inputs, cos, sin, next_head_dim)

    def last(
        self, hidden: torch.Tensor, attended: torch.Tensor, output: Output, head_dim: int, norm: Norm
    ) -> torch.Tensor:
        return self._norm(self._output(hidden, attended, *output, head_dim), *norm)


def _between(
    hidden: torch.Tensor,
    attended: torch.Tensor,
    output: Output,
    head_dim: int,
    inputs: Inputs,
    next_head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    hidden = layer_output(hidden, attended, *output, head_dim)
    return hidden, attention_inputs(hidden, *inputs, cos, sin, next_head_dim)


def _first(
    hidden: torch.Tensor, inputs: Inputs, head_dim: int, cos: torch.Tensor, sin: torch.Tensor
) -> list[torch.Tensor]:
    return attention_inputs(hidden, *inputs, cos, sin, head_dim)


def _last(hidden: torch.Tensor, attended: torch.Tensor, output: Output, head_dim: int, norm: Norm) -> torch.Tensor:
    return rms_norm(layer_output(hidden, attended, *output, head_dim), *norm)


def compile_cache_dir() -> Path:
    """Where inductor keeps compiled graphs: `$TORCHINDUCTOR_CACHE_DIR` where it names a directory other than
    inductor's own default (which inductor puts in the variable when it is imported), else
    `$XDG_CACHE_HOME/kakeya/inductor`, else `~/.cache/kakeya/inductor`."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    named = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if named and os.path.abspath(named) != os.path.abspath(default_cache_dir()):
        return Path(named)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kakeya" / "inductor"


class CompiledSteps:
    """The spans as graphs compiled by `torch.compile`, one call per layer. Compilation happens at a span's first
    call for each query-count class (one query; several) and raises what inductor raises (no C++ compiler, an
    operation it cannot lower)."""

    def __init__(self) -> None:
        # inductor reads the variable whenever it opens its cache
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(compile_cache_dir())
        self._first = torch.compile(_first)
        self._between = torch.compile(_between)
        self._last = torch.compile(_last)

    def first(
        self, hidden: torch.Tensor, inputs: Inputs, head_dim: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> list[torch.Tensor]:
        return self._first(hidden, inputs, head_dim, cos, sin)

    def between(
        self,
        hidden: torch.Tensor,
        attended: torch.Tensor,
        output: Output,
        head_dim: int,
        inputs: Inputs,
        next_head_dim: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self._between(hidden, attended, output, head_dim, inputs, next_head_dim, cos, sin)

    def last(
        self, hidden: torch.Tensor, attended: torch.Tensor, output: Output, head_dim: int, norm: Norm
    ) -> torch.Tensor:
        return self._last(hidden, attended, output, head_dim, norm)
