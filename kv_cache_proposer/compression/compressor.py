"""Choosing a KV compressor: its name and `q_range`, and the layer stores it builds on a backend."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

from kv_cache_proposer.cache.arrays import ArrayOps
from kv_cache_proposer.cache.layer_store import LayerStore, LayerStoreFactory
from kv_cache_proposer.compression.codec import LatticeCodec
from kv_cache_proposer.compression.lattice import MAX_Q_RANGE, LatticeKind, LatticeSpec
from kv_cache_proposer.compression.packed_store import PackedLayerStore

COMPRESSORS = ("none", "kakeya_d4", "kakeya_e8", "kakeya_d4s", "kakeya_e8s")
DEFAULT_Q_RANGE = 38
_LATTICES: dict[str, LatticeKind] = {"kakeya_d4": "d4", "kakeya_e8": "e8", "kakeya_d4s": "d4", "kakeya_e8s": "e8"}
# The one-scale variants: one fp16 scale per vector instead of a norm and a scale (see `lattice.py`).
_ONE_SCALE = ("kakeya_d4s", "kakeya_e8s")


@dataclass(frozen=True, slots=True)
class KVCompressor:
    """A session's KV compressor: `none` (dense K/V) or a KakeyaLattice lattice at `q_range` (`kakeya_d4`,
    `kakeya_e8`: the reference codec, bit for bit; `kakeya_d4s`, `kakeya_e8s`: the same lattices with one scale)."""

    name: str = "none"
    q_range: int = DEFAULT_Q_RANGE

    def __post_init__(self) -> None:
        if self.name not in COMPRESSORS:
            raise ValueError(f"unknown KV compressor {self.name!r}; expected one of {', '.join(COMPRESSORS)}")
        if self.lattice is not None and not 1 <= self.q_range <= MAX_Q_RANGE[self.lattice]:
            raise ValueError(f"q_range of {self.name} must be in [1, {MAX_Q_RANGE[self.lattice]}], got {self.q_range}")

    @property
    def label(self) -> str:
        """`none`, or `<name>:<q_range>` for a lattice: what `parse` reads back."""
        return self.name if self.lattice is None else f"{self.name}:{self.q_range}"

    @classmethod
    def parse(cls, label: str) -> KVCompressor:
        """The compressor a `label` names; raises `ValueError` for anything else."""
        name, _, q_range = label.partition(":")
        if not q_range:
            return cls(name)
        if not q_range.isdigit():
            raise ValueError(f"bad KV compressor label {label!r}")
        return cls(name, int(q_range))

    @property
    def lattice(self) -> LatticeKind | None:
        """The lattice of a KakeyaLattice compressor (None: no compression)."""
        return _LATTICES.get(self.name)

    def spec(self, head_dim: int) -> LatticeSpec:
        """The lattice layout for vectors of `head_dim` values."""
        if self.lattice is None:
            raise ValueError("the `none` compressor has no lattice")
        return LatticeSpec(self.lattice, head_dim, self.q_range, one_scale=self.name in _ONE_SCALE)


def _torch_codec(compressor: KVCompressor, like: Any) -> LatticeCodec[Any]:
    from kv_cache_proposer.backends.torch_backend.lattice_codec import TorchLatticeCodec

    return TorchLatticeCodec(compressor.spec(int(like.shape[-1])), like.device)


def _mlx_codec(compressor: KVCompressor, like: Any) -> LatticeCodec[Any]:
    from kv_cache_proposer.backends.mlx_backend.lattice_codec import MlxLatticeCodec

    return MlxLatticeCodec(compressor.spec(int(like.shape[-1])))


def compressor_layer_store(
    backend: str, compressor: KVCompressor, *, held: bool = True
) -> LayerStoreFactory[Any] | None:
    """The layer-store factory that makes `compressor` hold a session's K/V on `backend` (None: dense). `held`: a
    generating session keeps its residents as lattice coordinates where the backend's codec can be read so (the
    verifier's `reads_held_keys` says whether its attention does); otherwise decoded."""
    if compressor.lattice is None:
        return None
    if backend == "torch":
        codec_for = partial(_torch_codec, compressor)
    elif backend == "mlx":
        codec_for = partial(_mlx_codec, compressor)
    else:
        raise ValueError(f"no KakeyaLattice codec for backend {backend!r}")

    def factory(ops: ArrayOps[Any]) -> LayerStore[Any]:
        return PackedLayerStore(ops, codec_for, held=held)

    return factory
