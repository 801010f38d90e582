"""Linear layers held at another precision than the model's dtype: bfloat16, or weight-only int8 / int4 run by
PyTorch's packed CPU kernels.

A CPU decodes at the speed it reads weights, so these are its first lever; K/V, norms, attention and the residual
stream stay in the model's dtype, and only the matrix product runs on bfloat16 inputs (the packed kernels' fast
path), except on a CPU with AVX2, whose int4 layers multiply inputs quantized to 9-bit integers per group of 32 on
the product kernel (`INT4_QROWS`), and the int8 LM head's: its inputs meet its codes as integers
(`INT8_SPLIT`) on a CPU with int8 dot products, and its codes in float32 elsewhere (`INT8_FLOAT` on the product
kernel, else `DENSE_EXACT`; `integer_head_product`). int8 holds one symmetric scale per output channel; int4 holds
asymmetric 4-bit codes in groups of 32 inputs (a scale and a zero point per group), the layout of a GGUF Q4_1 block,
whose dequantized weights it represents exactly up to the bfloat16 rounding of the block's scale and offset. The token
embedding stays in the model's dtype (a lookup reads one row); a tied LM head gets its own quantized copy, held as int8
under int4: a 4-bit head moves a small model's answers (SmolLM2 answers the capital of France wrongly with one) where
every 4-bit block layer does not, which is also why GGUF files keep the head at 8 bits.
"""

from __future__ import annotations

import functools
import logging
from typing import Final

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from kv_cache_proposer.backends.torch_backend.products import (
    INT4_BLOCK,
    QROWS_TILE,
    code_offsets,
    float_head_serves,
    int4_qrows_serves,
    row_sums,
)
from kv_cache_proposer.errors import ModelLoadError

log = logging.getLogger(__name__)

# The `kind` of a linear for `linear`: how its weight is held.
DENSE, BF16, INT8, INT4 = 0, 1, 2, 3
# A float32 weight reordered for oneDNN's CPU product (`exact_dense`), whose sums for a row are the same whatever
# the count of rows beside it: PyTorch's default float32 product on a CPU sums rows of a product of fewer than 4
# rows (and, with several threads, of some counts above) in another order, so that a token's values would depend
# on how many tokens share its forward (a decode step alone, a batched step, a prefill chunk).
DENSE_EXACT = 4
# int8 codes whose product takes each input row as two int8 parts (the row at a scale of its own, then what that
# leaves at a finer one) and sums them in int32 with oneDNN's integer product (`split_int8_product`): exact sums,
# so a row's values never depend on the rows beside it, and the inputs meet the codes within about 2^-14 of a
# row's largest value where the packed kernel rounds them to bfloat16. It pays on a wide layer (the LM head, whose
# packed product costs almost as much per row as for one) and costs more than the packed kernel on the narrower
# layers of a transformer block; and only on a CPU with int8 dot products (`integer_head_product`).
INT8_SPLIT = 5
# int8 codes with one float32 scale per output, multiplied by float32 inputs on the product kernel, the codes widened
# to float32 there (`products.int8_float_head`): every sum in one order whatever the rows beside it, reading the codes'
# bytes rather than four times as many of their float32 values (`DENSE_EXACT`). An int8 head's product on a CPU
# without int8 dot products where the kernel serves it (AVX2).
INT8_FLOAT = 6
# int4 codes (`quantize_int4_qrows`) multiplied on the product kernel by each row quantized per group of 32 inputs to
# integers of 8 bits of magnitude and a sign (`products.int4_qrows`): exact integer sums of (code - 8) × input per
# group, then scaled in float32 group by group, the zero points meeting each group's float32 input sum. Close to a GGUF
# Q4_1 product as llama.cpp computes it (whose inputs have 8 bits per group), on the CPU's byte products (AVX2) or dot
# products (AVX512-VNNI; the same integer sums): every row's values the same whatever rows share the call, and
# several times as fast as bfloat16 inputs against dequantized weights for a block of rows. The int4 layers' product
# wherever the kernel's build has AVX2 and FMA.
INT4_QROWS = 7
INT4_GROUP: Final = 32
_KINDS: Final = {"bfloat16": BF16, "int8": INT8, "int4": INT4}


# Written as TorchScript source: the operator's scalar list is typed with TorchScript's own `number`.
_EXACT_SOURCE = """
def product(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    no_scalars = torch.jit.annotate(List[Optional[number]], [])
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", no_scalars, "")
"""
try:
    _exact_product = torch.jit.CompilationUnit(_EXACT_SOURCE).product
    _EXACT_PRODUCT = True
except RuntimeError:  # a PyTorch without oneDNN's linear operator: `exact_dense` declines, this is never called
    _exact_product = torch.jit.CompilationUnit(
        "def product(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:\n"
        "    return torch.nn.functional.linear(x, weight, bias)\n"
    ).product
    _EXACT_PRODUCT = False


def exact_dense(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` reordered for `DENSE_EXACT`, or None where that product does not serve it (not float32, not on a
    CPU, or PyTorch built without oneDNN)."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    if not _EXACT_PRODUCT or not torch.backends.mkldnn.is_available():
        _warn_inexact()
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


@functools.cache
def integer_head_product() -> bool:
    """Whether this CPU multiplies int8 by int8 with dot-product instructions (AVX-512 VNNI, AVX-VNNI, AMX), where
    oneDNN's integer product is fast; without them it runs a generic loop, slower than the float32 product of the
    same codes (docs/models.md, "The LM head's product")."""
    capabilities = torch.cpu.get_capabilities()
    return any(capabilities.get(name, False) for name in ("avx512_vnni", "avx_vnni", "amx_int8"))


@functools.cache
def _warn_inexact() -> None:
    log.warning(
        "this PyTorch has no oneDNN linear operator: float32 products run PyTorch's default kernel, and a token's "
        "values can differ in their last bits with the number of tokens in its forward"
    )


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    qparams: torch.Tensor | None,
    kind: int,
    group: int,
) -> torch.Tensor:
    """`x @ weight.T + bias` [..., out] for a weight held as `kind` says; the result in `x`'s dtype."""
    # literal kinds: TorchScript compiles this function and reads no module constants
    if kind == 0:  # DENSE
        return F.linear(x, weight, bias)
    if kind == 4:  # DENSE_EXACT (float32 weights; an int8 head's inputs may be in another dtype)
        return _exact_product(x.float(), weight, bias).to(x.dtype)
    if kind == 5:  # INT8_SPLIT
        assert qparams is not None
        return split_int8_product(x, weight, bias, qparams)
    if kind == 6:  # INT8_FLOAT
        assert qparams is not None
        y = torch.ops.kakeya.int8_float_head(x.reshape(-1, x.shape[-1]).float(), weight, qparams)
        return _as_output(y, x, bias)
    if kind == 7:  # INT4_QROWS
        assert qparams is not None
        return qrows_linear(x, weight, bias, qparams, None, 0.0)
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)  # [M, in]
    if kind == 1:  # BF16
        y = F.linear(rows, weight)
    elif kind == 2:  # INT8
        assert qparams is not None
        y = torch.ops.aten._weight_int8pack_mm(rows, weight, qparams)
    else:
        assert qparams is not None
        if rows.shape[0] >= 5:  # products.INT4_ROWS_FROM: the same values, each weight dequantized once
            y = torch.ops.kakeya.int4_rows(rows, weight, group, qparams)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, weight, group, qparams)
    return _as_output(y, x, bias)


def qrows_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    bias: torch.Tensor | None,
    qparams: torch.Tensor,
    norm: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """`linear` of an `INT4_QROWS` weight; with `norm`, of `x` under the RMS norm of that weight and `eps`, which
    the product kernel computes as it reads the rows (`products.int4_qrows`)."""
    y = torch.ops.kakeya.int4_qrows(x.reshape(-1, x.shape[-1]).float(), codes, qparams, norm, eps)
    return _as_output(y, x, bias)


def split_int8_product(
    x: torch.Tensor, codes: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor
) -> torch.Tensor:
    """`x @ (codes × scale).T + bias` for int8 `codes` [out, in] and float32 `scale` [out] (`INT8_SPLIT`)."""
    parts, high_scale, low_scale = int8_parts(x)
    sums = torch._int_mm(parts, codes.t())  # [2M, out]: exact integers
    return split_output(sums, high_scale, low_scale, scale, x, bias)


def int8_parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows of `x` [..., in] as two int8 parts each, `[2M, in]` (every row at a scale of its own, then what that
    leaves at a finer one), and the two scales [M, 1]."""
    rows = x.reshape(-1, x.shape[-1]).float()  # [M, in]
    tiny = 1.1754943508222875e-38  # float32's smallest normal (a row of zeros)
    high_scale = (rows.abs().amax(dim=-1, keepdim=True) / 127).clamp(min=tiny)  # [M, 1]
    high = torch.round(rows / high_scale).clamp(-127, 127)
    rest = rows - high * high_scale  # within half a step of high_scale
    low_scale = (rest.abs().amax(dim=-1, keepdim=True) / 127).clamp(min=tiny)
    parts = torch.cat([high, torch.round(rest / low_scale).clamp(-127, 127)]).to(torch.int8)  # [2M, in]
    return parts, high_scale, low_scale


def split_output(
    sums: torch.Tensor,
    high_scale: torch.Tensor,
    low_scale: torch.Tensor,
    scale: torch.Tensor,
    x: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The split product's output from the integer sums [2M, out] of its parts (`int8_parts`) with the codes."""
    count = high_scale.shape[0]
    totals = sums.float()
    return _as_output((totals[:count] * high_scale + totals[count:] * low_scale) * scale, x, bias)


def _as_output(y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A product's rows `y` [M, out] in `x`'s shape [..., out] and dtype, plus `bias`."""
    shape = list(x.shape[:-1])
    shape.append(y.shape[-1])
    y = y.to(x.dtype).reshape(shape)
    if bias is not None:
        y = y + bias
    return y


class PackedLinear(nn.Module):
    """A linear layer whose weight is held as bfloat16, int8 or int4 (`linear` computes it); `wide`: an int8 weight
    is multiplied as `_wide_int8` chooses, each way giving a row the same values whatever rows share its forward."""

    def __init__(self, source: nn.Linear, weights: str, *, wide: bool = False) -> None:
        super().__init__()
        self.kind = _KINDS[weights]
        self.group = INT4_GROUP if self.kind == INT4 else 0
        if self.kind == INT4 and int4_qrows_serves(source.out_features, source.in_features):
            self.kind = INT4_QROWS
        self.in_features, self.out_features = source.in_features, source.out_features
        dense = source.weight.detach().float()  # [out, in]
        qparams: torch.Tensor | None = None
        if self.kind == BF16:
            packed = dense.to(torch.bfloat16)
        elif self.kind == INT8:
            packed, qparams = quantize_int8(dense)
            if wide:
                self.kind, packed, qparams = _wide_int8(packed, qparams)
        elif self.kind == INT4_QROWS:
            packed, qparams = quantize_int4_qrows(dense)
        else:
            packed, qparams = quantize_int4(dense)
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.qparams = None if qparams is None else nn.Parameter(qparams, requires_grad=False)
        self.bias = None if source.bias is None else nn.Parameter(source.bias.detach(), requires_grad=False)
        self.code_offsets = code_offsets(packed) if self.kind == INT8_SPLIT else None  # `row_sums`'s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == INT8_SPLIT:  # the parts' integer sums on the compiled kernel where it serves them
            assert self.qparams is not None
            parts, high_scale, low_scale = int8_parts(x)
            sums = row_sums(parts, self.weight, self.code_offsets)
            return split_output(sums, high_scale, low_scale, self.qparams, x, self.bias)
        return linear(x, self.weight, self.bias, self.qparams, self.kind, self.group)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}"


def _wide_int8(codes: torch.Tensor, scale: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor | None]:
    """How a wide int8 layer's `codes` and bfloat16 `scale` (`quantize_int8`) are held and multiplied on this CPU, as
    (kind, weight, qparams): by `split_int8_product` (`INT8_SPLIT`) where this PyTorch has oneDNN and the CPU int8
    dot products; on the product kernel's float product (`INT8_FLOAT`) where it serves the layer; as the float32
    values of the codes for oneDNN's float32 product (`DENSE_EXACT`, 4x the bytes) where there is oneDNN only; by
    the packed int8 kernel (`INT8`) where there is none. The scales stay the same bfloat16-rounded values."""
    mkldnn = torch.backends.mkldnn.is_available()
    if mkldnn and integer_head_product():
        return INT8_SPLIT, codes, scale.float()
    if float_head_serves(int(codes.shape[1])):
        return INT8_FLOAT, codes, scale.float()
    if mkldnn:
        reordered = exact_dense(codes.float() * scale.float()[:, None])  # 7-bit codes times bfloat16 scales: exact
        if reordered is not None:
            return DENSE_EXACT, reordered, None
        return INT8_SPLIT, codes, scale.float()
    return INT8, codes, scale


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes [out, in] and one bfloat16 scale per output channel [out]: w ≈ code × scale."""
    scale = (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)  # [out]
    codes = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, scale.to(torch.bfloat16)


def int4_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes 0..15 [out, in] (int32), scales and zero points [out, in / 32] (float32) of `weight` [out, in]:
    w ≈ (code - 8) × scale + zero. Each group of 32 inputs spans its minimum to its maximum in 15 steps, as a GGUF
    Q4_1 block does, so the dequantized weights of a Q4_1 block get back that block's own codes."""
    out_features, in_features = weight.shape
    if in_features % INT4_GROUP:
        raise ModelLoadError(f"int4 weights need inputs in groups of {INT4_GROUP}; a layer has {in_features}")
    groups = weight.reshape(out_features, in_features // INT4_GROUP, INT4_GROUP)  # [out, G, 32]
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [out, G]
    scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    return codes.reshape(out_features, in_features), scale, low + 8 * scale


def int4_values(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The weights [out, in] (float32) that codes, scales and zero points (`int4_codes`) stand for."""
    out_features, in_features = codes.shape
    groups = codes.reshape(out_features, -1, INT4_GROUP).float()  # [out, G, 32]
    return ((groups - 8) * scale.float()[..., None] + zero.float()[..., None]).reshape(out_features, in_features)


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed int4 codes of `weight` [out, in] and its scales and zero points [in / 32, out, 2] (bfloat16), as
    `_weight_int4pack_mm_for_cpu` reads them."""
    codes, scale, zero = int4_codes(weight)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    qparams = torch.stack([scale.t(), zero.t()], dim=-1).contiguous().to(torch.bfloat16)  # [G, out, 2]
    return packed, qparams


def quantize_int4_qrows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int4 codes of `weight` [out, in] as the kernel's product over quantized rows reads them (`INT4_QROWS`): uint8
    [out / 8, 4 × in], each tile of 8 outputs' codes for 4 inputs in 16 bytes (byte i: element i in its low nibble,
    element 16 + i in its high one; element e: output e / 4, input e % 4), and the tiles' bfloat16 scales and zero
    points [out / 8, in / 32, 2, 8]: the values `quantize_int4` holds, in another layout."""
    codes, scale, zero = int4_codes(weight)
    out_features, in_features = codes.shape
    tiles = out_features // QROWS_TILE
    quads = codes.reshape(tiles, QROWS_TILE, in_features // 4, 4).permute(0, 2, 1, 3).reshape(tiles, -1, 32)
    packed = (quads[..., :16] | (quads[..., 16:] << 4)).to(torch.uint8).reshape(tiles, 4 * in_features)
    groups = in_features // INT4_GROUP
    held = torch.stack([scale, zero]).to(torch.bfloat16)  # [2, out, groups]
    qparams = held.reshape(2, tiles, QROWS_TILE, groups).permute(1, 3, 0, 2).contiguous()  # [tiles, groups, 2, 8]
    return packed.contiguous(), qparams


def stack_int4(modules: list[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, int, int] | None:
    """One product for int4 layers that read the same input (a layer's Q/K/V projections; its gate and up), as
    `linear` takes it (weight, bias, qparams, kind, group): their codes stacked along the outputs, and each module's
    own weight made a view of the stack (no second copy). Every output gets the same values bit for bit as from its
    own layer, since the kernel computes blocks of `INT4_BLOCK` outputs alike (`INT4_QROWS`: tiles of
    `QROWS_TILE`); None (nothing changed) unless every module is an int4 `PackedLinear` of one kind and group size
    whose outputs fill whole blocks, all with biases or none."""
    packed = [m for m in modules if isinstance(m, PackedLinear) and m.kind in (INT4, INT4_QROWS)]
    if len(packed) != len(modules) or len(packed) < 2 or len({(m.kind, m.group) for m in packed}) != 1:
        return None
    kind = packed[0].kind
    # how the kind holds outputs: whole blocks of how many stack, outputs per weight row, the qparams' output dim
    block, per_row, dim = (INT4_BLOCK, 1, 1) if kind == INT4 else (QROWS_TILE, QROWS_TILE, 0)
    if any(m.out_features % block for m in packed) or len({m.bias is None for m in packed}) != 1:
        return None
    weight = torch.cat([m.weight for m in packed])
    start = 0
    for module in packed:
        rows = module.out_features // per_row
        module.weight = nn.Parameter(weight[start : start + rows], requires_grad=False)
        start += rows
    qparams = torch.cat([m.qparams for m in packed if m.qparams is not None], dim=dim)
    biases: list[torch.Tensor] = [m.bias for m in packed if m.bias is not None]
    bias = torch.cat(biases) if biases else None
    return weight, bias, qparams, kind, packed[0].group


def held_values(weight: torch.Tensor, weights: str) -> torch.Tensor:
    """The float32 weights a `PackedLinear` of `weights` holds for `weight` [out, in]: what its kernel multiplies
    by, up to the rounding of its inputs (to bfloat16; `INT8_SPLIT`: to two int8 parts; `INT4_QROWS`: to 9-bit
    integers per group of 32; an int8 head as `DENSE_EXACT` and `INT8_FLOAT`: none)."""
    dense = weight.detach().float()
    if weights == "bfloat16":
        return dense.to(torch.bfloat16).float()
    if weights == "int8":
        codes, scale = quantize_int8(dense)
        return codes.float() * scale.float()[:, None]
    codes, scale, zero = int4_codes(dense)
    return int4_values(codes, scale.to(torch.bfloat16), zero.to(torch.bfloat16))


def pack_linears(model: nn.Module, weights: str) -> int:
    """Replace every linear layer of `model` (the LM head included, untied from the embedding) by a `PackedLinear`
    holding `weights` (bfloat16, int8 or int4; the LM head int8 under int4, multiplied as `_wide_int8` chooses);
    returns how many were replaced."""
    if weights not in _KINDS:
        raise ValueError(f"pack_linears takes bfloat16, int8 or int4, not {weights!r}")
    device = next(model.parameters()).device
    if weights in ("int8", "int4") and device.type != "cpu":
        raise ModelLoadError(
            f"--weights {weights} runs on a CPU (PyTorch's packed CPU kernels); on {device.type} use "
            "float32 or bfloat16"
        )
    head = model.get_output_embeddings() if isinstance(model, PreTrainedModel) else None
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                held = "int8" if weights == "int4" and child is head else weights
                setattr(module, name, PackedLinear(child, held, wide=child is head))
                replaced += 1
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "tie_word_embeddings", False):
        config.tie_word_embeddings = False  # the head is its own packed copy now; nothing may re-tie it
    return replaced
