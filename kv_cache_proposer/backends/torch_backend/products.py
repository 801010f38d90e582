"""Linear layers' products on the compiled kernel (`products.c`, `avx2_products.c`, `layer_spans.c`), each but the
float head and int4 over quantized rows giving exactly the values of the PyTorch kernel it stands in for, so a token's
values are the same bit for bit whichever computes them:

- the int8 LM head's integer sums for a decode step or a short block (`row_sums`, up to `MAX_INT8_ROWS` rows): the
  codes read once in place with AVX512-VNNI dot products, where oneDNN's `_int_mm` repacks them at every call;
  longer blocks keep `_int_mm`, whose packed product pays from there.
- the int8 LM head on a CPU without int8 dot products (`int8_float_head`): float32 rows times its int8 codes widened
  to float32 in the kernel, a quarter of the bytes of the codes' float32 values. This one is the kernel's own
  arithmetic, not a PyTorch kernel's (every sum in one order for any row count and thread count), chosen when the
  head is loaded (`weights.PackedLinear`); where the kernel is off the head holds the float32 values instead.
- int4 layers on a CPU with AVX2 (`int4_qrows`): every row quantized per group of 32 inputs to integers of 8 bits of
  magnitude and a sign, multiplied by the codes with byte products (AVX2) or dot products (AVX512-VNNI, the same
  exact integer sums), the sums per group scaled in float32: the kernel's own arithmetic again (close to a GGUF Q4_1
  product's), chosen at load (`weights.INT4_QROWS`), for every row count alike; given the RMS norm before the
  product, it computes that too, row by row in its own order (`layer_steps.normed_products`).
- int4 layers the quantized rows do not serve, over blocks of `INT4_ROWS_FROM` rows or more on AVX-512
  (`torch.ops.kakeya.int4_rows`: a verify block, a batched step, a prefill chunk): `_weight_int4pack_mm_for_cpu`'s
  arithmetic, each block of weights dequantized once for all the rows where that kernel dequantizes it once per 4. A
  lone row keeps PyTorch's kernel.

Built with the machine's C compiler on first use (`kernel_build`): `products.c` the exact stand-ins,
`avx2_products.c` and `layer_spans.c` the kernel's own arithmetic. Where that fails, the CPU lacks the instructions
(AVX512-VNNI for int8, AVX2 for the float head and quantized rows, AVX-512 for int4 blocks), PyTorch does not run its
AVX-512 int4 kernel (whose layout and arithmetic the int4 blocks reproduce; checked against it once at load), or
`KAKEYA_PRODUCT_KERNEL=off` asks, PyTorch's kernels compute every product. What runs is logged once, with the reason."""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

import torch

from kv_cache_proposer.backends.torch_backend.kernel_build import EXACT_FLAGS, built

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("products.c")
AVX2_SOURCES = (Path(__file__).with_name("avx2_products.c"), Path(__file__).with_name("layer_spans.c"))
"""The products in the kernel's own arithmetic (the float head, int4 over quantized rows) and the layer spans built
on them, one library."""
ENV = "KAKEYA_PRODUCT_KERNEL"
MAX_INT8_ROWS = 6
"""Input rows (a split product's parts: two per token) up to which the kernel computes the int8 head's sums:
measured against `_int_mm` on the default model's head (49,152 × 576), one and two threads
(docs/models.md#the-lm-heads-product)."""
INT4_ROWS_FROM = 5
"""Rows from which an int4 layer's product runs on the kernel (`weights.linear` reads this number as a literal):
from 5, PyTorch's kernel dequantizes every weight twice or more (docs/models.md#weights)."""
INT4_MAX_ROWS = 64
"""Rows of one kernel call (`INT4_MAX_ROWS` of products.c); more are computed 64 at a time."""
INT4_BLOCK = 64
"""Outputs of the largest packed block of PyTorch's int4 kernel (its `BLOCK_N`: 64 on AVX-512, 32 on AVX2), whose
blocks it computes alike, so layers whose outputs fill whole blocks of this many can be stacked on either
(`weights.stack_int4`). The compiled kernel reproduces PyTorch's AVX-512 kernel, in blocks of this many."""
INT4_MAX_GROUP = 256
QROWS_TILE = 8
"""Outputs whose int4 codes the kernel's product over quantized rows holds interleaved (`Q_TILE` of avx2_products.c)."""
FLOAT_HEAD_MAX_WIDTH = 8192
"""Inputs of a row the float head serves at most (`HEAD_MAX_WIDTH` of avx2_products.c); a multiple of 8."""

_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


@dataclass(frozen=True, slots=True)
class ProductKernel:
    """The loaded kernel, what it serves on this CPU, and where its library lies."""

    int8_sums: Any
    int4_rows: Any
    library: Path
    serves_int8: bool
    serves_int4: bool
    float_head: Any = None
    serves_float_head: bool = False
    int4_qrows: Any = None
    serves_int4_qrows: bool = False
    int4_span: Any = None
    """A decoder layer's work between attentions over int4 layers of quantized rows (`kernel_steps.KernelSteps`)."""
    silu_times: Any = None
    """SiLU(gate) × up as that work computes it."""

    def sums(self, rows: torch.Tensor, codes: torch.Tensor, offsets: torch.Tensor, threads: int) -> torch.Tensor:
        """`rows @ codes.T` for int8 `rows` [M, in] (each value in [-127, 127]) and int8 `codes` [out, in] whose
        rows are contiguous, `offsets` from `code_offsets(codes)`: int32 [M, out] (a transposed view)."""
        out = torch.empty(int(codes.shape[0]), int(rows.shape[0]), dtype=torch.int32)
        _over_code_rows(self.int8_sums, "int8 row kernel", rows.contiguous(), codes, offsets, out, threads)
        return out.t()

    def float_head_product(
        self, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, threads: int
    ) -> torch.Tensor:
        """`x @ codes.T × scale` for float32 `x` [M, D], int8 `codes` [O, D] with contiguous rows and float32 `scale`
        [O]: float32 [M, O], each sum over the inputs in the kernel's order, then scaled."""
        if x.dtype != torch.float32:
            raise ValueError("the float head reads float32 rows")
        out = torch.empty(int(x.shape[0]), int(codes.shape[0]), dtype=torch.float32)
        _over_code_rows(self.float_head, "float head", x.contiguous(), codes, scale.contiguous(), out, threads)
        return out

    def int4_product(
        self, rows: torch.Tensor, weight: torch.Tensor, group: int, qparams: torch.Tensor, threads: int
    ) -> torch.Tensor:
        """`_weight_int4pack_mm_for_cpu(rows, weight, group, qparams)` for bfloat16 `rows` [M, K], bit for bit."""
        rows, weight, qparams = rows.contiguous(), weight.contiguous(), qparams.contiguous()
        count, width = (int(s) for s in rows.shape)
        outputs = int(weight.shape[0])
        out = torch.empty(count, outputs, dtype=torch.bfloat16)
        for start in range(0, count, INT4_MAX_ROWS):
            end = min(count, start + INT4_MAX_ROWS)
            status = self.int4_rows(
                rows[start].data_ptr(),
                end - start,
                weight.data_ptr(),
                qparams.data_ptr(),
                out[start].data_ptr(),
                outputs,
                width,
                group,
                threads,
            )
            if status != 0:
                raise ValueError(f"the int4 row kernel does not serve {outputs} outputs of {width} inputs")
        return out

    def int4_qrows_product(
        self,
        x: torch.Tensor,
        codes: torch.Tensor,
        qparams: torch.Tensor,
        threads: int,
        norm: torch.Tensor | None = None,
        eps: float = 0.0,
    ) -> torch.Tensor:
        """float32 `x` [M, K] times int4 weights held for the kernel's product over quantized rows
        (`weights.quantize_int4_qrows`: `codes` [N / 8, 4K] uint8, `qparams` [N / 8, K / 32, 2, 8] bfloat16): float32
        [M, N]. With `norm` (float32 [K]), of the rows under the RMS norm of that weight and `eps`, computed by the
        kernel as it reads them."""
        if x.dtype != torch.float32 or codes.dtype != torch.uint8 or qparams.dtype != torch.bfloat16:
            raise ValueError("the int4 quantized-row kernel reads float32 rows, uint8 codes and bfloat16 qparams")
        x, codes, qparams = x.contiguous(), codes.contiguous(), qparams.contiguous()
        count, width = (int(s) for s in x.shape)
        tiles = int(codes.shape[0])
        outputs = tiles * QROWS_TILE
        if int(codes.shape[1]) != 4 * width or tuple(qparams.shape) != (tiles, width // 32, 2, QROWS_TILE):
            raise ValueError(f"int4 codes of shape {tuple(codes.shape)} do not take rows of {width} inputs")
        if norm is not None and (norm.dtype != torch.float32 or tuple(norm.shape) != (width,)):
            raise ValueError(f"the norm before an int4 product of rows of {width} inputs is float32 [{width}]")
        norm = None if norm is None else norm.contiguous()
        out = torch.empty(count, outputs, dtype=torch.float32)
        status = self.int4_qrows(
            x.data_ptr(),
            count,
            None if norm is None else norm.data_ptr(),
            eps,
            codes.data_ptr(),
            qparams.data_ptr(),
            out.data_ptr(),
            outputs,
            width,
            threads,
        )
        if status == -2:
            raise MemoryError(f"the int4 quantized-row kernel could not hold {count} rows of {width} inputs")
        if status != 0:
            raise ValueError(f"the int4 quantized-row kernel does not serve {outputs} outputs of {width} inputs")
        return out


def _over_code_rows(
    function: Any,
    name: str,
    x: torch.Tensor,
    codes: torch.Tensor,
    per_code: torch.Tensor,
    out: torch.Tensor,
    threads: int,
) -> None:
    """Run a kernel function over contiguous input rows `x` [M, D] and code rows `codes` [O, D] (each of contiguous
    values) with one value per code row `per_code` [O], into `out`; raises where the kernel declines the shapes."""
    count, width = (int(s) for s in x.shape)
    if codes.stride(1) != 1 or int(codes.shape[1]) != width:
        raise ValueError(f"the {name} reads code rows of contiguous values as long as the input rows")
    status = function(
        x.data_ptr(),
        count,
        codes.data_ptr(),
        int(codes.shape[0]),
        width,
        int(codes.stride(0)),
        per_code.data_ptr(),
        out.data_ptr(),
        threads,
    )
    if status != 0:
        raise ValueError(f"the {name} does not serve {count} rows of {width} values")


def code_offsets(codes: torch.Tensor) -> torch.Tensor:
    """128 × the sum of each code row, int32 [out]: what the kernel takes off the sums of rows it reads shifted by
    128 (its dot products multiply unsigned by signed bytes)."""
    return (codes.sum(dim=1, dtype=torch.int32) * 128).to(torch.int32).contiguous()


def row_sums(rows: torch.Tensor, codes: torch.Tensor, offsets: torch.Tensor | None) -> torch.Tensor:
    """Exact int32 sums `rows @ codes.T` [M, out] of int8 `rows` [M, in] and `codes` [out, in]: on the kernel where
    `offsets` are given, it serves int8 and the rows are few, else `_int_mm`."""
    kernel = product_kernel() if offsets is not None and rows.shape[0] <= MAX_INT8_ROWS else None
    if kernel is None or not kernel.serves_int8 or offsets is None:
        return torch._int_mm(rows, codes.t())
    return kernel.sums(rows, codes, offsets, torch.get_num_threads())


def float_head_serves(width: int) -> bool:
    """Whether the kernel multiplies an int8 head of `width` inputs (`int8_float_head`) on this CPU."""
    kernel = product_kernel()
    served = kernel is not None and kernel.serves_float_head
    return served and width % 8 == 0 and 8 <= width <= FLOAT_HEAD_MAX_WIDTH


def int8_float_head(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x @ codes.T × scale` on the kernel (`ProductKernel.float_head_product`) for a head held for it
    (`float_head_serves`)."""
    kernel = product_kernel()
    if kernel is None or not kernel.serves_float_head:
        raise RuntimeError("an int8 head held for the product kernel's float product, which is not loaded")
    return kernel.float_head_product(x, codes, scale, torch.get_num_threads())


def int4_serves(weight: torch.Tensor, group: int, width: int) -> bool:
    """Whether the kernel's int4 path, in blocks of `INT4_BLOCK` outputs, reads a layer of packed `weight`
    [N, K / 2] and `group`."""
    outputs = int(weight.shape[0])
    return outputs >= INT4_BLOCK and outputs % INT4_BLOCK == 0 and 0 < group <= INT4_MAX_GROUP and width % group == 0


def int4_rows(rows: torch.Tensor, weight: torch.Tensor, group: int, qparams: torch.Tensor) -> torch.Tensor:
    """`_weight_int4pack_mm_for_cpu(rows, weight, group, qparams)`, bit for bit: on the kernel where it serves this
    layer, else PyTorch's kernel."""
    kernel = product_kernel()
    if kernel is None or not kernel.serves_int4 or not int4_serves(weight, group, int(rows.shape[-1])):
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, weight, group, qparams)
    return kernel.int4_product(rows, weight, group, qparams, torch.get_num_threads())


def int4_qrows_serves(outputs: int, width: int) -> bool:
    """Whether the kernel's int4 product over quantized rows (`int4_qrows`) serves a layer of `outputs` x `width`
    on this CPU (a build with AVX2 and FMA)."""
    kernel = product_kernel()
    served = kernel is not None and kernel.serves_int4_qrows
    return served and outputs >= QROWS_TILE and outputs % QROWS_TILE == 0 and width >= 32 and width % 32 == 0


def int4_qrows(
    x: torch.Tensor, codes: torch.Tensor, qparams: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0
) -> torch.Tensor:
    """`x` [M, K] times int4 weights held for the kernel's product over quantized rows, with `norm`: of the rows
    under the RMS norm of that weight and `eps`, computed by the kernel as it reads them
    (`ProductKernel.int4_qrows_product`)."""
    kernel = product_kernel()
    if kernel is None or not kernel.serves_int4_qrows:
        raise RuntimeError("int4 weights held for the product kernel's quantized rows, which it does not compute")
    return kernel.int4_qrows_product(x, codes, qparams, torch.get_num_threads(), norm, eps)


_LIBRARY = torch.library.Library("kakeya", "DEF")
_LIBRARY.define("int4_rows(Tensor rows, Tensor weight, int group, Tensor qparams) -> Tensor")
_LIBRARY.impl("int4_rows", int4_rows, "CPU")
_LIBRARY.define("int8_float_head(Tensor x, Tensor codes, Tensor scale) -> Tensor")
_LIBRARY.impl("int8_float_head", int8_float_head, "CPU")
_LIBRARY.define("int4_qrows(Tensor x, Tensor codes, Tensor qparams, Tensor? norm=None, float eps=0.0) -> Tensor")
_LIBRARY.impl("int4_qrows", int4_qrows, "CPU")


@torch.library.register_fake("kakeya::int4_rows")
def _int4_rows_shape(rows: torch.Tensor, weight: torch.Tensor, group: int, qparams: torch.Tensor) -> torch.Tensor:
    return rows.new_empty((rows.shape[0], weight.shape[0]), dtype=torch.bfloat16)


@torch.library.register_fake("kakeya::int4_qrows")
def _int4_qrows_shape(
    x: torch.Tensor, codes: torch.Tensor, qparams: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0
) -> torch.Tensor:
    return x.new_empty((x.shape[0], codes.shape[0] * QROWS_TILE), dtype=torch.float32)


@torch.library.register_fake("kakeya::int8_float_head")
def _float_head_shape(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], codes.shape[0]), dtype=torch.float32)


@cache
def product_kernel() -> ProductKernel | None:
    """The kernel, built if needed, or None (the reason logged) where it cannot be, serves nothing on this CPU or
    is turned off."""
    setting = os.environ.get(ENV, "auto").strip().lower()
    if setting in ("off", "0", "false", "no"):
        log.info("product kernel: PyTorch's kernels (%s=%s)", ENV, setting)
        return None
    try:
        library = built(SOURCE, EXACT_FLAGS)
        loaded, own = ctypes.CDLL(str(library)), ctypes.CDLL(str(built(AVX2_SOURCES, EXACT_FLAGS)))
        int8_sums, int8_served = loaded.int8_row_sums, loaded.int8_rows_served
        int4, int4_served = loaded.int4_rows, loaded.int4_rows_served
        float_head, float_head_served = own.int8_float_head, own.int8_float_head_served
        int4_qrows, int4_qrows_served = own.int4_qrows, own.int4_qrows_served
        int4_span, silu_times = own.int4_span, own.silu_times
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        log.warning("product kernel: PyTorch's kernels, the compiled kernel is unavailable (%s)", exc)
        return None
    int8_sums.argtypes, int8_sums.restype = [_P, _I, _P, _I64, _I, _I64, _P, _P, _I], _I
    int4.argtypes, int4.restype = [_P, _I, _P, _P, _P, _I64, _I, _I, _I], _I
    float_head.argtypes, float_head.restype = [_P, _I, _P, _I64, _I, _I64, _P, _P, _I], _I
    int4_qrows.argtypes, int4_qrows.restype = [_P, _I, _P, _F, _P, _P, _P, _I64, _I, _I], _I
    int4_span.argtypes, int4_span.restype = [_P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I], _I
    silu_times.argtypes, silu_times.restype = [_P, _P, _I64, _P], _I
    for served in (int8_served, int4_served, float_head_served, int4_qrows_served):
        served.argtypes, served.restype = [], _I
    kernel = ProductKernel(
        int8_sums,
        int4,
        library,
        bool(int8_served()),
        serves_int4=False,
        float_head=float_head,
        serves_float_head=bool(float_head_served()),
        int4_qrows=int4_qrows,
        serves_int4_qrows=bool(int4_qrows_served()),
        int4_span=int4_span,
        silu_times=silu_times,
    )
    why = _int4_unserved(kernel, int(int4_served()))
    if why is None:
        kernel = replace(kernel, serves_int4=True)
    if not (kernel.serves_int8 or kernel.serves_int4 or kernel.serves_float_head or kernel.serves_int4_qrows):
        log.info("product kernel: PyTorch's kernels (no AVX512-VNNI for int8, no AVX2; int4: %s)", why)
        return None
    if kernel.serves_int8:
        head_says = "the int8 head's sums"
    elif kernel.serves_float_head:
        head_says = "the int8 head's float product (no AVX512-VNNI)"
    else:
        head_says = "not the int8 head (neither AVX512-VNNI nor AVX2)"
    int4_says = f"int4 blocks of {INT4_ROWS_FROM}+ rows" if kernel.serves_int4 else f"not int4 ({why})"
    if kernel.serves_int4_qrows:
        dots = "AVX512-VNNI" if torch.cpu.get_capabilities().get("avx512_vnni", False) else "AVX2"
        int4_says = f"int4 layers over rows quantized to 9 bits ({dots}; any others: {int4_says})"
    log.info("product kernel: compiled kernel %s for %s, %s", library, head_says, int4_says)
    return kernel


def _int4_unserved(kernel: ProductKernel, block: int) -> str | None:
    """Why the kernel's int4 path (built for blocks of `block` outputs: `INT4_BLOCK` on AVX-512, else 0) must not
    stand in for PyTorch's here, or None where it gives its values."""
    if block != INT4_BLOCK:
        return "no AVX-512"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX512":
        return f"PyTorch runs its {capability} int4 kernel"
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (128, 96), generator=generator, dtype=torch.int32)
    weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    qparams = torch.randn(3, 128, 2, generator=generator).to(torch.bfloat16)
    rows = torch.randn(7, 96, generator=generator).to(torch.bfloat16)
    expected = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, weight, 32, qparams)
    if not torch.equal(kernel.int4_product(rows, weight, 32, qparams, 1), expected):
        log.warning("product kernel: int4 rows differ from PyTorch's kernel here; PyTorch's computes them")
        return "its values differ from PyTorch's kernel here"
    return None
