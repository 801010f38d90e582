"""Part 1 of `scripts/bench_kv_compression.py`: rate–distortion of KV quantisers on K/V captured from real forwards.

Bits per value are what a store holds (for the lattices: packed codes, fp16 norm and scale, escapes); relative MSE
is Σ(x̂−x)² / Σx². Next to KakeyaLattice D4 and E8: affine group-64 quantisation as mlx-lm's quantised KV cache
does it (`mx.quantize`), fp8 e4m3 with a per-tensor scale as vLLM's fp8 KV cache does it, and bf16.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from kv_cache_proposer.backends import load_verifier
from kv_cache_proposer.backends.torch_backend.lattice_codec import TorchLatticeCodec
from kv_cache_proposer.compression import LatticeSpec
from kv_cache_proposer.compression.lattice import LatticeKind, block_indices
from kv_cache_proposer.strategies import FullStrategy


def capture_kv(model: Path, tokens: list[int]) -> dict[str, torch.Tensor]:
    """K and V `[N, D]` of every layer after real forwards of the model (float32) over `tokens`."""
    verifier = load_verifier("torch", model, device="cpu", dtype="float32")
    cache = verifier.new_cache(FullStrategy())
    for start in range(0, len(tokens), 512):
        chunk = tokens[start : start + 512]
        verifier.verify(cache, chunk, 1)
        cache.commit(len(chunk))
    keys, values = [], []
    for layer in range(cache.num_layers):
        k, v, _ = cache.resident_kv(layer)
        keys.append(k.reshape(-1, k.shape[-1]))
        values.append(v.reshape(-1, v.shape[-1]))
    return {"K": torch.cat(keys), "V": torch.cat(values)}


def _rel_mse(x: torch.Tensor, approx: torch.Tensor) -> float:
    return float(((approx.float() - x) ** 2).sum() / (x**2).sum())


def lattice_point(kind: LatticeKind, q: int, x: torch.Tensor) -> dict[str, Any]:
    spec = LatticeSpec(kind, int(x.shape[-1]), q)
    codec = TorchLatticeCodec(spec, torch.device("cpu"))
    coding = codec.encode(x)
    _, escaped = block_indices(spec, coding.doubled)
    held_bits = spec.held_bytes(coding.count, int(escaped.sum())) * 8  # what the packed store holds
    decoded = codec.decode(coding, tuple(x.shape), torch.float32)
    return {
        "method": f"kakeya_{kind}",
        "q_range": q,
        "budget_bits_per_value": spec.bits_per_vector / spec.head_dim,
        "bits_per_value": held_bits / (coding.count * spec.head_dim),
        "rel_mse": _rel_mse(x, decoded),
        "escaped_block_fraction": float(escaped.mean()),
    }


def affine_point(bits: int, x: torch.Tensor) -> dict[str, Any]:
    import mlx.core as mx

    data = mx.array(x.numpy()).astype(mx.bfloat16)
    packed, scales, biases = mx.quantize(data, group_size=64, bits=bits)
    approx = mx.dequantize(packed, scales, biases, group_size=64, bits=bits).astype(mx.float32)
    # Scale and bias per group of 64, each in the input dtype (bf16).
    return {
        "method": f"affine{bits}_g64",
        "bits_per_value": bits + 32 / 64,
        "rel_mse": _rel_mse(x, torch.from_numpy(np.array(approx))),
    }


def fp8_point(x: torch.Tensor) -> dict[str, Any]:
    scale = x.abs().max() / torch.finfo(torch.float8_e4m3fn).max
    approx = (x / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale
    return {"method": "fp8_e4m3", "bits_per_value": 8.0, "rel_mse": _rel_mse(x, approx)}


def rate_distortion(kv: dict[str, torch.Tensor], d4_q: list[int], e8_q: list[int]) -> list[dict[str, Any]]:
    """Bits per value and relative MSE of every method on each of `kv`'s tensors (K, V)."""
    points = []
    for tensor, x in kv.items():
        rows = [lattice_point("d4", q, x) for q in d4_q] + [lattice_point("e8", q, x) for q in e8_q]
        rows += [affine_point(4, x), affine_point(8, x), fp8_point(x)]
        rows.append({"method": "bf16", "bits_per_value": 16.0, "rel_mse": _rel_mse(x, x.to(torch.bfloat16))})
        points += [{"tensor": tensor, **row} for row in rows]
    return points


def lattice_vs_affine4(points: list[dict[str, Any]]) -> list[str]:
    """Plain sentences: at the bits of affine 4-bit, does each lattice do better or worse (interpolated)?"""
    lines = []
    for tensor in ("K", "V"):
        affine = next(p for p in points if p["tensor"] == tensor and p["method"] == "affine4_g64")
        for method in ("kakeya_d4", "kakeya_e8"):
            curve = sorted(
                (p["bits_per_value"], p["rel_mse"]) for p in points if p["tensor"] == tensor and p["method"] == method
            )
            bits = [b for b, _ in curve]
            if not bits[0] <= affine["bits_per_value"] <= bits[-1]:
                lines.append(f"{tensor}: {method} has no point around {affine['bits_per_value']:.2f} bits/value")
                continue
            log_mse = float(np.interp(affine["bits_per_value"], bits, [np.log(m) for _, m in curve]))
            mse = float(np.exp(log_mse))
            verdict = "beats" if mse < affine["rel_mse"] else "loses to"
            lines.append(
                f"{tensor}: at {affine['bits_per_value']:.2f} bits/value {method} {verdict} affine 4-bit g64 "
                f"(rel MSE {mse:.2e} vs {affine['rel_mse']:.2e})"
            )
    return lines
