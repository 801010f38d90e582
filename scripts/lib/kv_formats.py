"""K/V cache formats as reference quantizers: what each format holds of a K or V vector and what it reads back.

Every format here codes each K or V vector `[D]` (one head of one position) on its own, as the cache that uses it
stores them, and gives back `(read back [N, D] float32, bits held per value)`:

- `none`, `bf16`, `f16`: the dense formats (32, 16, 16 bits).
- `kakeya_d4:Q`, `kakeya_e8:Q`: this project's codec (`TorchLatticeCodec`, the packed store's coding), with the
  bits the packed store actually holds: codes, fp16 norm and scale, and the escape table; `kakeya_d4s:Q`,
  `kakeya_e8s:Q`: its one-scale variants (one fp16 scale per vector, no norm).
- `q8_0`, `q4_0`: llama.cpp's K/V cache types, ggml's reference row quantizers (`quantize_row_q8_0_ref`,
  `quantize_row_q4_0_ref`): blocks of 32 values along the head dimension with an fp16 scale; q8_0 rounds
  `x / (amax / 127)` half away from zero, q4_0 takes the signed value of largest magnitude `m`, `d = m / -8`, and
  stores `trunc(x / d + 8.5)` clamped to [0, 15]. 8.5 and 4.5 bits.
- `q8_0_rot`, `q4_0_rot`: the same behind llama.cpp's attention rotation (on by default for quantized K/V since
  2026): K and V are multiplied by the normalised Walsh–Hadamard matrix of the head dimension before they are
  stored (Q is rotated alike, and the attention output rotated back), so what attention reads is `H·dq(q(H·x))`.
- `fp8_e4m3`: vLLM's and SGLang's fp8 K/V cache at its default per-tensor scale of 1.0 (no calibration): a
  saturating cast to e4m3. 8 bits.
- `affine8_g64`, `affine4_g64`: mlx-lm's quantized K/V cache (`mx.quantize`, groups of 64 values, 8 or 4 bits),
  with the scale and bias of each group in a 16-bit model dtype (float16 here): 8.5 and 4.5 bits. The scale is
  chosen as MLX chooses it: the group's range over the levels, snapped so that the edge of larger magnitude is an
  exact level, that edge being the bias.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch

from kv_cache_proposer.backends.torch_backend.lattice_codec import TorchLatticeCodec
from kv_cache_proposer.compression import COMPRESSORS, KVCompressor
from kv_cache_proposer.compression.lattice import block_indices

Roundtrip = Callable[[torch.Tensor], tuple[torch.Tensor, float]]

GGML_BLOCK = 32
MLX_GROUP = 64
FP8_E4M3_MAX = 448.0


@dataclass(frozen=True, slots=True)
class KVFormat:
    """A named K/V format: `roundtrip(x [N, D])` gives the values read back and the bits held per value."""

    name: str
    family: str  # "dense", "kakeya" or "field" (what users pick instead)
    roundtrip: Roundtrip


def _blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    if x.shape[-1] % size:
        raise ValueError(f"head dimension {x.shape[-1]} is not a multiple of the block size {size}")
    return x.float().reshape(-1, size)


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C's `roundf` (ggml's rounding): halves go away from zero."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def q8_0(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """ggml's `quantize_row_q8_0_ref` and its dequantization."""
    blocks = _blocks(x, GGML_BLOCK)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    inverse = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    codes = _round_half_away(blocks * inverse)
    read = codes * d.to(torch.float16).float()
    return read.reshape(x.shape), 8.0 + 16.0 / GGML_BLOCK


def q4_0(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """ggml's `quantize_row_q4_0_ref` and its dequantization."""
    blocks = _blocks(x, GGML_BLOCK)
    largest = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))  # the signed value of largest magnitude
    d = largest / -8.0
    inverse = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    codes = torch.trunc(blocks * inverse + 8.5).clamp(0, 15)
    read = (codes - 8.0) * d.to(torch.float16).float()
    return read.reshape(x.shape), 4.0 + 16.0 / GGML_BLOCK


@cache
def hadamard(dim: int) -> torch.Tensor:
    """The normalised Sylvester Walsh–Hadamard matrix `[dim, dim]` (symmetric, its own inverse)."""
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"a Walsh–Hadamard rotation needs a power-of-two dimension, got {dim}")
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / dim**0.5


def rotated(inner: Roundtrip) -> Roundtrip:
    """`inner` applied to the vectors rotated by the head dimension's Walsh–Hadamard matrix, read back rotated back."""

    def roundtrip(x: torch.Tensor) -> tuple[torch.Tensor, float]:
        h = hadamard(int(x.shape[-1]))
        read, bits = inner(x.float() @ h)
        return read @ h, bits

    return roundtrip


def fp8_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """A saturating cast to fp8 e4m3 at scale 1.0 (vLLM's uncalibrated fp8 K/V cache)."""
    held = x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return held.float(), 8.0


def affine(bits: int, group: int = MLX_GROUP, stored: torch.dtype = torch.float16) -> Roundtrip:
    """MLX's affine quantization (`mx.quantize` / `mx.dequantize`) in groups of `group` values, its scale and bias
    held in `stored` (float32 reproduces `mx.quantize` on float32 input bit for bit)."""
    levels = float(2**bits - 1)

    def roundtrip(x: torch.Tensor) -> tuple[torch.Tensor, float]:
        groups = _blocks(x, group)
        high = groups.amax(dim=-1, keepdim=True)
        low = groups.amin(dim=-1, keepdim=True)
        below = low.abs() > high.abs()
        scale = ((high - low) / levels).clamp(min=1e-7)
        scale = torch.where(below, scale, -scale)
        edge = torch.where(below, low, high)
        steps = torch.round(edge / scale)
        scale = torch.where(steps != 0, edge / steps, scale)
        bias = torch.where(steps == 0, torch.zeros_like(edge), edge)
        codes = torch.round((groups - bias) / scale).clamp(0, levels)
        scale, bias = scale.to(stored).float(), bias.to(stored).float()
        read = codes * scale + bias
        side_bits = 2 * torch.finfo(stored).bits
        return read.reshape(x.shape), bits + side_bits / group

    return roundtrip


def dense(dtype: torch.dtype) -> Roundtrip:
    def roundtrip(x: torch.Tensor) -> tuple[torch.Tensor, float]:
        return x.to(dtype).float(), float(torch.finfo(dtype).bits)

    return roundtrip


def kakeya(compressor: KVCompressor) -> Roundtrip:
    """The packed store's coding under `compressor`: what its codes decode to, and its held bits per value
    (`LatticeSpec.held_bytes`: codes, fp16 scales, escapes)."""

    def roundtrip(x: torch.Tensor) -> tuple[torch.Tensor, float]:
        spec = compressor.spec(int(x.shape[-1]))
        codec = TorchLatticeCodec(spec, torch.device("cpu"))
        flat = x.float().reshape(-1, spec.head_dim)
        coding = codec.encode(flat)
        _, escaped = block_indices(spec, coding.doubled)
        held = spec.held_bytes(coding.count, int(escaped.sum()))
        read = codec.decode(coding, tuple(flat.shape), torch.float32)
        return read.reshape(x.shape), 8.0 * held / (coding.count * spec.head_dim)

    return roundtrip


def kv_format(name: str) -> KVFormat:
    """The format called `name` (module docstring; the lattices as `kakeya_d4:Q`, `kakeya_e8s:Q`, ...)."""
    base, _, q = name.partition(":")
    if base in COMPRESSORS and base != "none":
        if not q.isdigit():
            raise ValueError(f"{base} needs its Q range, as in {base}:38")
        return KVFormat(name, "kakeya", kakeya(KVCompressor(base, int(q))))
    if q:
        raise ValueError(f"format {base} takes no parameter")
    field: dict[str, Roundtrip] = {
        "q8_0": q8_0,
        "q4_0": q4_0,
        "q8_0_rot": rotated(q8_0),
        "q4_0_rot": rotated(q4_0),
        "fp8_e4m3": fp8_e4m3,
        "affine8_g64": affine(8),
        "affine4_g64": affine(4),
    }
    if base in field:
        return KVFormat(name, "field", field[base])
    plain = {"none": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
    if base in plain:
        return KVFormat(name, "dense", dense(plain[base]))
    raise ValueError(f"unknown K/V format {name!r}")
