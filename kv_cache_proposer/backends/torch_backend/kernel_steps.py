"""The direct forward's compute between attentions in one call of the product kernel per layer (`int4_span` of
layer_spans.c), where every layer's products are int4 over quantized rows (`weights.INT4_QROWS`: a CPU with
AVX2): the earlier layer's output projection, residual, norm, SiLU MLP and residual, then the next layer's norm,
Q/K/V and rotary embedding, with no PyTorch operation or Python between them. A decode step of the
default model otherwise spends about as long dispatching the span's twenty-odd small operations as in its products.

Every step computes each row on its own, so a token's values do not depend on the block it came in or the rows
beside it. The products, norms, residuals and rotary embedding are those of `ScriptedSteps` bit for bit; SiLU is the
kernel's own (x / (1 + exp(-x)) with its exponential, within a few ulp of PyTorch's), so tokens can differ from a
forward through `ScriptedSteps` where two are nearly tied."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from kv_cache_proposer.backends.torch_backend.layer_steps import Inputs, Linear, Norm, Output, rms_norm
from kv_cache_proposer.backends.torch_backend.products import QROWS_TILE, product_kernel
from kv_cache_proposer.backends.torch_backend.weights import INT4_QROWS

_P, _I64, _F, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


class _QProduct(ctypes.Structure):
    _fields_ = [("codes", _P), ("qparams", _P), ("bias", _P), ("outputs", _I64)]


class _SpanOutput(ctypes.Structure):
    _fields_ = [
        ("wo", _QProduct),
        ("norm", _P),
        ("eps", _F),
        ("parts", _I),
        ("gate_up", _QProduct * 2),
        ("down", _QProduct),
        ("heads", _I),
        ("head_dim", _I),
        ("inter", _I),
    ]


class _SpanInputs(ctypes.Structure):
    _fields_ = [
        ("norm", _P),
        ("eps", _F),
        ("parts", _I),
        ("qkv", _QProduct * 3),
        ("q_heads", _I),
        ("kv_heads", _I),
        ("head_dim", _I),
    ]


def _width(w: Linear) -> int:
    """The inputs of an int4 product over quantized rows (its codes hold 4 bytes per input per tile)."""
    return int(w[0].shape[1]) // 4


def _outputs(w: Linear) -> int:
    return int(w[0].shape[0]) * QROWS_TILE


def _product(w: Linear) -> _QProduct:
    codes, bias, qparams = w[0], w[1], w[2]
    assert qparams is not None
    return _QProduct(codes.data_ptr(), qparams.data_ptr(), 0 if bias is None else bias.data_ptr(), _outputs(w))


def _held(w: Linear) -> bool:
    """Whether the kernel reads this product as it is held: int4 over quantized rows, its tensors contiguous, a
    float32 bias or none."""
    codes, bias, qparams, kind = w[0], w[1], w[2], w[3]
    return (
        kind == INT4_QROWS
        and qparams is not None
        and codes.is_contiguous()
        and qparams.is_contiguous()
        and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
    )


def _norm_held(norm: torch.Tensor, width: int) -> bool:
    return norm.dtype == torch.float32 and norm.is_contiguous() and tuple(norm.shape) == (width,)


def serves(layers: Sequence[tuple[Inputs, Output, int]], hidden: int) -> bool:
    """Whether the kernel computes the spans of these layers (each its `inputs`, `output` and head size) with
    hidden size `hidden`: every product int4 over quantized rows, no Q/K norms, widths of whole 8-lane vectors and
    heads of a multiple of 16 values, float32 norms."""
    kernel = product_kernel()
    if kernel is None or kernel.int4_span is None or not kernel.serves_int4_qrows or hidden % 8:
        return False
    for inputs, output, head_dim in layers:
        norm, _, projections, sizes, q_norm, k_norm, _ = inputs
        wo, post_norm, _, gate_up, down = output
        products = [*projections, wo, *gate_up, down]
        if q_norm is not None or k_norm is not None or head_dim % 16 or not all(_held(w) for w in products):
            return False
        if len(sizes) != 3 or any(size % head_dim for size in sizes) or sizes[1] != sizes[2]:
            return False
        if not (_norm_held(norm, hidden) and _norm_held(post_norm, hidden)):
            return False
        if any(_width(w) != hidden for w in (*projections, *gate_up)) or _outputs(wo) != hidden:
            return False
        split = [_outputs(w) for w in projections]
        if split != ([sum(sizes)] if len(projections) == 1 else list(sizes)) or _width(wo) % head_dim:
            return False
        inter = _width(down)
        halves = [_outputs(w) for w in gate_up]
        if halves != ([2 * inter] if len(gate_up) == 1 else [inter, inter]) or _outputs(down) != hidden:
            return False
    return True


class KernelSteps:
    """The spans in one call of the product kernel each (module docstring); for layers `serves` accepts."""

    def __init__(self) -> None:
        kernel = product_kernel()
        assert kernel is not None and kernel.int4_span is not None
        self._span = kernel.int4_span
        self._outputs: dict[int, tuple[Output, _SpanOutput]] = {}
        self._inputs: dict[int, tuple[Inputs, _SpanInputs]] = {}

    def first(
        self, hidden: torch.Tensor, inputs: Inputs, head_dim: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> list[torch.Tensor]:
        _, qkv = self._run(hidden, None, None, (inputs, head_dim, cos, sin))
        assert qkv is not None
        return qkv

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
        hidden, qkv = self._run(hidden, attended, (output, head_dim), (inputs, next_head_dim, cos, sin))
        assert qkv is not None
        return hidden, qkv

    def last(
        self, hidden: torch.Tensor, attended: torch.Tensor, output: Output, head_dim: int, norm: Norm
    ) -> torch.Tensor:
        hidden, _ = self._run(hidden, attended, (output, head_dim), None)
        return rms_norm(hidden, *norm)

    def _run(
        self,
        hidden: torch.Tensor,
        attended: torch.Tensor | None,
        output: tuple[Output, int] | None,
        inputs: tuple[Inputs, int, torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        hidden = hidden.float().contiguous()
        batch, n, width = (int(s) for s in hidden.shape)
        out_w = in_w = None
        hidden_out = hidden
        attended_at = 0
        if output is not None:
            assert attended is not None
            out_w = self._output_span(*output)
            attended = attended.float().contiguous()
            if int(attended.numel()) != batch * n * out_w.heads * out_w.head_dim:
                raise ValueError(f"attention's output of shape {tuple(attended.shape)} does not fill {batch}×{n} rows")
            attended_at = attended.data_ptr()
            hidden_out = torch.empty_like(hidden)
        qkv: list[torch.Tensor] | None = None
        pointers: list[Any] = [0] * 5
        if inputs is not None:
            in_w = self._input_span(inputs[0], inputs[1])
            dim = in_w.head_dim
            cos, sin = (_per_row(x, batch, n, dim) for x in inputs[2:])
            qkv = [torch.empty(batch, heads, n, dim) for heads in (in_w.q_heads, in_w.kv_heads, in_w.kv_heads)]
            pointers = [cos.data_ptr(), sin.data_ptr(), *(x.data_ptr() for x in qkv)]
        status = self._span(
            None if out_w is None else ctypes.byref(out_w),
            None if in_w is None else ctypes.byref(in_w),
            hidden.data_ptr(),
            attended_at,
            hidden_out.data_ptr(),
            *pointers,
            batch,
            n,
            width,
            torch.get_num_threads(),
        )
        if status == -2:
            raise MemoryError(f"the layer-span kernel could not hold the scratch of {batch * n} rows")
        if status != 0:
            raise ValueError(f"the layer-span kernel does not serve {batch * n} rows of {width} values")
        return hidden_out, qkv

    def _output_span(self, output: Output, head_dim: int) -> _SpanOutput:
        held = self._outputs.get(id(output))
        if held is not None and held[0] is output:
            return held[1]
        wo, norm, eps, gate_up, down = output
        span = _SpanOutput()
        span.wo, span.norm, span.eps, span.parts = _product(wo), norm.data_ptr(), eps, len(gate_up)
        for i, w in enumerate(gate_up):
            span.gate_up[i] = _product(w)
        span.down, span.inter = _product(down), _width(down)
        span.heads, span.head_dim = _width(wo) // head_dim, head_dim
        self._outputs[id(output)] = (output, span)  # the tuple kept: its id names no other while it lives
        return span

    def _input_span(self, inputs: Inputs, head_dim: int) -> _SpanInputs:
        held = self._inputs.get(id(inputs))
        if held is not None and held[0] is inputs:
            return held[1]
        norm, eps, projections, sizes = inputs[:4]
        span = _SpanInputs()
        span.norm, span.eps, span.parts = norm.data_ptr(), eps, len(projections)
        for i, w in enumerate(projections):
            span.qkv[i] = _product(w)
        span.q_heads, span.kv_heads, span.head_dim = sizes[0] // head_dim, sizes[1] // head_dim, head_dim
        self._inputs[id(inputs)] = (inputs, span)
        return span


def silu_times(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) × up as the span computes it, for float32 tensors of one shape whose size is a multiple of 8."""
    kernel = product_kernel()
    if kernel is None or kernel.silu_times is None:
        raise RuntimeError("the product kernel is not loaded")
    gate, up = gate.float().contiguous(), up.float().contiguous()
    if gate.shape != up.shape or gate.numel() % 8:
        raise ValueError(f"SiLU × up of shapes {tuple(gate.shape)} and {tuple(up.shape)}")
    out = torch.empty_like(gate)
    if kernel.silu_times(gate.data_ptr(), up.data_ptr(), gate.numel(), out.data_ptr()) != 0:
        raise ValueError("this build of the product kernel has no AVX2")
    return out


def _per_row(x: torch.Tensor, batch: int, n: int, dim: int) -> torch.Tensor:
    """The rotary table `x` ([B, 1, n, D] or [B, n, D]) as float32 [B, n, D], contiguous."""
    if x.dtype == torch.float32 and x.is_contiguous() and x.numel() == batch * n * dim:
        return x  # as it lies: [B, n, D]
    return x.reshape(-1, n, dim).expand(batch, n, dim).float().contiguous()
