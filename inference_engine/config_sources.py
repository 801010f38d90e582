"""Where the daemon's options come from: defaults, a TOML file, `KAKEYA_*` environment variables and flags, merged
into a `ServerConfig` in that order of precedence; and the option table `--help` and the configuration reference
are generated from."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import MISSING, fields
from typing import Any

from inference_engine.config import ENV_PREFIX, ConfigError, ServerConfig


def option_help() -> list[tuple[str, type, Any, str, tuple[str, ...] | None]]:
    """(name, type, default, help, choices) of every option, in declaration order."""
    out = []
    for f in fields(ServerConfig):
        default = f.default if f.default is not MISSING else None
        kind = type(default)
        out.append((f.name, kind, default, f.metadata["help"], f.metadata.get("choices")))
    return out


def env_var(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _coerce(name: str, kind: type, raw: Any, source: str) -> Any:
    if isinstance(raw, kind) and not (kind is int and isinstance(raw, bool)):
        return raw
    if kind is float and isinstance(raw, int) and not isinstance(raw, bool):
        return float(raw)
    if isinstance(raw, str):
        try:
            return kind(raw)
        except ValueError:
            pass
    raise ConfigError(f"{name} from {source}: expected {kind.__name__}, got {raw!r}")


def load_config(
    overrides: Mapping[str, Any], *, config_file: str | None = None, environ: Mapping[str, str] | None = None
) -> ServerConfig:
    """Merge defaults, an optional TOML file, `KAKEYA_*` environment variables and explicit overrides (flags)."""
    environ = os.environ if environ is None else environ
    kinds = {name: kind for name, kind, _, _, _ in option_help()}
    values: dict[str, Any] = {}
    config_file = config_file or environ.get(ENV_PREFIX + "CONFIG") or None
    if config_file:
        try:
            with open(config_file, "rb") as handle:
                table = tomllib.load(handle)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {config_file}: {exc}") from exc
        for key, raw in table.items():
            name = key.replace("-", "_")
            if name not in kinds:
                raise ConfigError(f"unknown option {key!r} in {config_file}")
            values[name] = _coerce(name, kinds[name], raw, config_file)
    for name, kind in kinds.items():
        raw_env = environ.get(env_var(name))
        if raw_env is not None:
            values[name] = _coerce(name, kind, raw_env, env_var(name))
    for name, raw in overrides.items():
        if raw is not None:
            values[name] = _coerce(name, kinds[name], raw, f"--{name.replace('_', '-')}")
    return ServerConfig(**values)
