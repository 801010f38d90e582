"""Restoration plans: for each verifier layer, where the K/V of evicted positions come from, and the manifest
(JSON + safetensors) that carries a plan in a model directory.

Sources of a layer:

- `tokens`: rebuilt exactly from the token ids by the layers' own projections (only valid for a layer whose K/V
  depend on nothing but the token and its position, such as the first layer of a standard decoder).
- `kept`: the layer's own K/V of every evicted position are kept (through the session's KV compressor when it has
  one, else through the plan's `kept_compressor`, else dense).
- `projected`: a linear map f_θ from the kept K/V of another layer (`from_layer`), or from the DFlash drafter's
  per-position context state (`from_drafter`; the plan carries the drafter's context weights, `drafter`). A map
  may work in the keys' unrotated frame (`"frame": "unrotated"`; the manifest then carries the verifier's rotary
  frequencies, `rotary`).
- `recompute`: a cache-less forward of the verifier checkpoint over the token prefix: the exact reference.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from kv_cache_proposer.compression import KVCompressor
from kv_cache_proposer.restoration.drafter_context import DrafterContext
from kv_cache_proposer.restoration.projection import LinearProjection, Rotary

SourceKind = Literal["tokens", "kept", "projected", "recompute"]
SOURCES: tuple[SourceKind, ...] = ("tokens", "kept", "projected", "recompute")
PLAN_FILE = "restore_plan.json"
FORMAT = "kakeya-restoration-plan/1"


@dataclass(frozen=True, slots=True)
class LayerSource:
    """Where one layer's evicted K/V come from."""

    kind: SourceKind
    from_layer: int | None = None  # `projected`: the kept layer whose K/V f_θ reads
    projection: LinearProjection | None = None  # `projected`: f_θ (None: identity)
    from_drafter: bool = False  # `projected`: f_θ reads the DFlash drafter's context state instead of a kept layer

    def __post_init__(self) -> None:
        if self.kind not in SOURCES:
            raise ValueError(f"unknown restoration source {self.kind!r}; expected one of {', '.join(SOURCES)}")
        origins = (self.from_layer is not None) + self.from_drafter
        if (self.kind == "projected") != (origins == 1) or origins > 1:
            raise ValueError(
                "a `projected` source names what it projects from (a kept layer `from_layer`, or `from_drafter`); "
                "no other does"
            )

    def describe(self) -> str:
        """`tokens`, `kept`, `recompute`, `projected<-L3` or `projected<-drafter`."""
        if self.from_drafter:
            return "projected<-drafter"
        return self.kind if self.from_layer is None else f"projected<-L{self.from_layer}"


@dataclass(frozen=True, slots=True)
class RestorationPlan:
    """One source per verifier layer, plus what the plan was made for."""

    layers: tuple[LayerSource, ...]
    verifier: str = ""  # the model the plan was measured on (informational)
    notes: dict[str, Any] = field(default_factory=dict)
    # The KV compressor label (`none`, `kakeya_d4`, `kakeya_e8:Q`) that packs the kept layers' K/V of sessions
    # without a compressor of their own; a session's own compressor packs them otherwise.
    kept_compressor: str = "none"
    drafter: DrafterContext | None = None  # the drafter context `projected<-drafter` layers read

    def __post_init__(self) -> None:
        KVCompressor.parse(self.kept_compressor)  # raises ValueError naming a bad label
        if self.uses_drafter and self.drafter is None:
            raise ValueError("a layer projects from the drafter context, but the plan carries no drafter context")
        for index, source in enumerate(self.layers):
            if source.from_drafter and source.projection is None:
                raise ValueError(f"layer {index} projects from the drafter context: it needs a linear f_θ")
        for index, source in enumerate(self.layers):
            if source.from_layer is None:
                continue
            if not 0 <= source.from_layer < len(self.layers):
                raise ValueError(f"layer {index} projects from layer {source.from_layer}, which the model lacks")
            if self.layers[source.from_layer].kind != "kept":
                raise ValueError(f"layer {index} projects from layer {source.from_layer}, whose K/V are not kept")
        _ = self.rotary  # raises ValueError when the maps turn keys by different rotaries

    @classmethod
    def uniform(cls, num_layers: int, kind: SourceKind) -> RestorationPlan:
        """Every layer from the same source (`recompute`: the exact reference; `kept`: keep everything)."""
        return cls(tuple(LayerSource(kind) for _ in range(num_layers)))

    @property
    def kept_layers(self) -> tuple[int, ...]:
        """Layers whose K/V of evicted positions the session keeps."""
        return tuple(i for i, source in enumerate(self.layers) if source.kind == "kept")

    @property
    def forward_layers(self) -> tuple[int, ...]:
        """Layers rebuilt by a forward of the model over tokens (`tokens` and `recompute`)."""
        return tuple(i for i, source in enumerate(self.layers) if source.kind in ("tokens", "recompute"))

    @property
    def needs_tokens(self) -> bool:
        """Whether the session keeps the token ids of evicted positions."""
        return bool(self.forward_layers)

    @property
    def needs_prefix_forward(self) -> bool:
        """Whether rebuilding reads the whole token prefix (a `recompute` layer) rather than each evicted token."""
        return any(source.kind == "recompute" for source in self.layers)

    @property
    def uses_drafter(self) -> bool:
        """Whether a layer is projected from the drafter's context state (then the session keeps it per position)."""
        return any(source.from_drafter for source in self.layers)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Verifier layers whose outputs the session needs from every forward (the drafter context's inputs)."""
        return self.drafter.target_layer_ids if self.drafter is not None and self.uses_drafter else ()

    @property
    def rotary(self) -> Rotary | None:
        """The rotary of the maps that work in the keys' unrotated frame (one for the whole plan), if any."""
        turns = [s.projection.rotary for s in self.layers if s.projection is not None and s.projection.rotary]
        if turns and not all(turn.same_as(turns[0]) for turn in turns):
            raise ValueError("the plan's maps turn keys by different rotaries")
        return turns[0] if turns else None

    @property
    def kept_fraction(self) -> float:
        """Bytes kept per evicted position, as a fraction of the full K/V of that position (before compression)."""
        return len(self.kept_layers) / len(self.layers) if self.layers else 0.0

    def with_projections(self, projections: dict[int, LinearProjection]) -> RestorationPlan:
        """The same plan with the f_θ of the given `projected` layers replaced."""
        layers = tuple(
            LayerSource(source.kind, source.from_layer, projections[index], source.from_drafter)
            if index in projections
            else source
            for index, source in enumerate(self.layers)
        )
        return replace(self, layers=layers, notes=dict(self.notes))

    def with_kept_compressor(self, label: str) -> RestorationPlan:
        """The same plan with its kept layers packed by the compressor `label` (`none`: dense)."""
        return replace(self, notes=dict(self.notes), kept_compressor=label)

    def describe(self) -> str:
        """One line: the source of every layer (and the kept layers' compressor, when the plan names one)."""
        line = ", ".join(f"L{i}:{source.describe()}" for i, source in enumerate(self.layers))
        return line if self.kept_compressor == "none" else f"{line} (kept: {self.kept_compressor})"

    def check_model(self, num_layers: int) -> None:
        """Raises `ValueError` when the plan does not fit a model of `num_layers` layers."""
        if len(self.layers) != num_layers:
            raise ValueError(f"the restoration plan has {len(self.layers)} layers, the model {num_layers}")

    # -- manifest ------------------------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write the manifest to `path` (a directory gets `restore_plan.json`) and the f_θ weights next to it."""
        from safetensors.numpy import save_file

        manifest_path = _manifest_path(Path(path))
        manifest_path.parent.mkdir(parents=True, exist_ok=True)
        weights_name = manifest_path.with_suffix(".safetensors").name
        tensors: dict[str, np.ndarray] = {}
        layers: list[dict[str, Any]] = []
        for index, source in enumerate(self.layers):
            entry: dict[str, Any] = {"source": source.kind}
            if source.from_layer is not None or source.from_drafter:
                if source.from_drafter:
                    entry["from"] = {"kind": "drafter_context"}
                else:
                    entry["from"] = {"kind": "kept_layer", "layer": source.from_layer}
                if source.projection is None:
                    entry["projection"] = {"kind": "identity"}
                else:
                    entry["projection"] = {"kind": "linear", "tensors": f"layers.{index}"}
                    tensors[f"layers.{index}.weight"] = source.projection.weight
                    tensors[f"layers.{index}.bias"] = source.projection.bias
                    if source.projection.rotary is not None:
                        entry["projection"]["frame"] = "unrotated"
            layers.append(entry)
        manifest: dict[str, Any] = {"format": FORMAT, "verifier": self.verifier, "proposer": "verifier"}
        manifest["layers"] = layers
        rotary = self.rotary
        if rotary is not None:
            manifest["rotary"] = {"scale": rotary.scale, "tensors": "rotary"}
            tensors["rotary.inv_freq"] = rotary.inv_freq.astype(np.float32)
        if self.kept_compressor != "none":
            manifest["kept_compressor"] = self.kept_compressor
        if self.drafter is not None:
            manifest["drafter_context"] = {
                "target_layer_ids": list(self.drafter.target_layer_ids),
                "eps": self.drafter.eps,
                "tensors": "drafter_context",
            }
            tensors["drafter_context.fc.weight"] = self.drafter.fc_weight
            tensors["drafter_context.hidden_norm.weight"] = self.drafter.norm_weight
        if tensors:
            manifest["weights"] = weights_name
            save_file(tensors, str(manifest_path.with_suffix(".safetensors")))
        if self.notes:
            manifest["notes"] = self.notes
        manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
        return manifest_path

    @classmethod
    def load(cls, path: str | Path) -> RestorationPlan:
        """Read a manifest (a file, or a model directory holding `restore_plan.json`); raises `ValueError`
        naming what is wrong."""
        manifest_path = _manifest_path(Path(path))
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read restoration plan {manifest_path}: {exc}") from exc
        if manifest.get("format") != FORMAT:
            raise ValueError(f"{manifest_path} is not a {FORMAT} manifest")
        if manifest.get("proposer", "verifier") != "verifier":
            raise ValueError(f"{manifest_path}: only the verifier checkpoint itself can run `recompute` forwards")
        tensors = _load_weights(manifest_path, manifest.get("weights"))
        try:
            rotary = _rotary(manifest.get("rotary"), tensors)
        except ValueError as exc:
            raise ValueError(f"{manifest_path}: {exc}") from None
        layers = tuple(_layer_source(entry, index, tensors, rotary) for index, entry in enumerate(manifest["layers"]))
        try:
            return cls(
                layers,
                verifier=str(manifest.get("verifier", "")),
                notes=dict(manifest.get("notes", {})),
                kept_compressor=str(manifest.get("kept_compressor", "none")),
                drafter=_drafter_context(manifest.get("drafter_context"), tensors),
            )
        except ValueError as exc:
            raise ValueError(f"{manifest_path}: {exc}") from None


def find_plan(model_dir: str | Path) -> Path | None:
    """The manifest a model directory ships, if any."""
    candidate = Path(model_dir) / PLAN_FILE
    return candidate if candidate.is_file() else None


def _manifest_path(path: Path) -> Path:
    return path / PLAN_FILE if path.is_dir() or not path.suffix else path


def _load_weights(manifest_path: Path, name: str | None) -> dict[str, np.ndarray]:
    if name is None:
        return {}
    from safetensors.numpy import load_file

    weights_path = manifest_path.parent / name
    try:
        return load_file(str(weights_path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read restoration weights {weights_path}: {exc}") from exc


def _rotary(entry: dict[str, Any] | None, tensors: dict[str, np.ndarray]) -> Rotary | None:
    if entry is None:
        return None
    prefix = str(entry.get("tensors", "rotary"))
    try:
        inv_freq = tensors[f"{prefix}.inv_freq"]
    except KeyError as exc:
        raise ValueError(f"the weights file lacks the rotary's {exc.args[0]}") from None
    return Rotary(inv_freq.astype(np.float32), float(entry.get("scale", 1.0)))


def _layer_source(
    entry: dict[str, Any], index: int, tensors: dict[str, np.ndarray], rotary: Rotary | None
) -> LayerSource:
    kind = entry.get("source")
    if kind not in SOURCES:
        raise ValueError(f"layer {index}: unknown restoration source {kind!r}; expected one of {', '.join(SOURCES)}")
    if kind != "projected":
        return LayerSource(kind)
    origin = entry.get("from", {})
    if origin.get("kind") not in ("kept_layer", "drafter_context"):
        raise ValueError(
            f"layer {index}: projected source {origin.get('kind')!r} is not supported; "
            "f_θ reads the kept K/V of another layer (`kept_layer`) or the drafter's context (`drafter_context`)"
        )
    from_drafter = origin["kind"] == "drafter_context"
    from_layer = None if from_drafter else int(origin["layer"])
    projection = entry.get("projection", {"kind": "identity"})
    if projection.get("kind") == "identity":
        return LayerSource("projected", from_layer=from_layer, from_drafter=from_drafter)
    if projection.get("kind") != "linear":
        raise ValueError(f"layer {index}: unknown projection {projection.get('kind')!r}")
    prefix = str(projection["tensors"])
    try:
        weight, bias = tensors[f"{prefix}.weight"], tensors[f"{prefix}.bias"]
    except KeyError as exc:
        raise ValueError(f"layer {index}: the weights file lacks {exc.args[0]}") from None
    frame = projection.get("frame", "stored")
    if frame not in ("stored", "unrotated"):
        raise ValueError(f"layer {index}: unknown key frame {frame!r}; expected stored or unrotated")
    if frame == "unrotated" and rotary is None:
        raise ValueError(f"layer {index}: f_θ maps unrotated keys, and the manifest names no `rotary`")
    turn = rotary if frame == "unrotated" else None
    try:
        linear = LinearProjection(weight, bias, turn, reads_keys=turn is not None and not from_drafter)
    except ValueError as exc:
        raise ValueError(f"layer {index}: {exc}") from None
    return LayerSource("projected", from_layer=from_layer, projection=linear, from_drafter=from_drafter)


def _drafter_context(entry: dict[str, Any] | None, tensors: dict[str, np.ndarray]) -> DrafterContext | None:
    if entry is None:
        return None
    prefix = str(entry.get("tensors", "drafter_context"))
    try:
        fc, norm = tensors[f"{prefix}.fc.weight"], tensors[f"{prefix}.hidden_norm.weight"]
    except KeyError as exc:
        raise ValueError(f"the weights file lacks the drafter context's {exc.args[0]}") from None
    return DrafterContext(tuple(int(i) for i in entry["target_layer_ids"]), fc, norm, float(entry.get("eps", 1e-6)))


def plan_from_spec(spec: str, num_layers: int, drafter: DrafterContext | None = None) -> RestorationPlan:
    """A plan from a compact spec: one source per layer, comma-separated (`tokens,projected<-3,projected<-3,kept`),
    or one source for every layer (`recompute`). `projected<-J` projects from kept layer J through an identity f_θ
    (`scripts/train_f_theta.py` fits a linear one); `projected<-drafter` from `drafter`'s context, through a zero
    f_θ until one is fitted. Raises `ValueError` naming what is wrong."""
    parts = [part.strip() for part in spec.split(",")]
    if len(parts) == 1:
        parts = parts * num_layers
    if len(parts) != num_layers:
        raise ValueError(f"restoration spec {spec!r} names {len(parts)} layers, the model has {num_layers}")
    layers = []
    for part in parts:
        kind, _, origin = part.partition("<-")
        if kind == "projected" and origin.isdigit():
            layers.append(LayerSource("projected", from_layer=int(origin)))
        elif kind == "projected" and origin == "drafter":
            if drafter is None:
                raise ValueError(f"restoration spec {spec!r}: `projected<-drafter` needs the drafter's context")
            placeholder = LinearProjection(np.zeros((drafter.width, 1), np.float32), np.zeros(1, np.float32))
            layers.append(LayerSource("projected", projection=placeholder, from_drafter=True))
        elif kind in ("tokens", "kept", "recompute") and not origin:
            layers.append(LayerSource(kind))  # type: ignore[arg-type]
        else:
            raise ValueError(
                f"restoration spec {spec!r}: {part!r} is not tokens, kept, recompute, projected<-J or "
                "projected<-drafter"
            )
    return RestorationPlan(tuple(layers), drafter=drafter if any(s.from_drafter for s in layers) else None)
