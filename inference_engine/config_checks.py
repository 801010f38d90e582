"""The checks of a whole server configuration (`config.ServerConfig`): each value in its range or among its choices,
and the options that only make sense together."""

from __future__ import annotations

import ipaddress
from dataclasses import fields
from typing import TYPE_CHECKING

from kv_cache_proposer.backends.mlx_blas import MLX_BLAS_CHOICES

if TYPE_CHECKING:
    from inference_engine.config import ServerConfig

ENV_PREFIX = "KAKEYA_"


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the option."""


def check(config: ServerConfig) -> None:
    """Raise `ConfigError` naming the first option that is out of range, not among its choices, or at odds with
    another."""
    for f in fields(config):
        choices = f.metadata.get("choices")
        value = getattr(config, f.name)
        if choices and value not in choices:
            raise ConfigError(f"{f.name}: {value!r} is not one of {', '.join(choices)}")
    positive = (
        "window",
        "max_sessions",
        "max_concurrent",
        "kv_budget_bytes",
        "max_history_tokens",
        "max_append_tokens",
        "max_generate_tokens",
        "max_top_logprobs",
        "max_stop_sequences",
        "max_stop_sequence_tokens",
        "grammar_cache_size",
        "max_message_bytes",
    )
    for name in positive:
        if getattr(config, name) < 1:
            raise ConfigError(f"{name} must be >= 1, got {getattr(config, name)}")
    for name in ("session_idle_ttl_s", "queue_deadline_s"):
        if not getattr(config, name) > 0:
            raise ConfigError(f"{name} must be > 0, got {getattr(config, name)}")
    for name in (
        "threads",
        "max_batch_size",
        "prefill_chunk_tokens",
        "decode_burst_tokens",
        "state_kv_max_bytes",
        "kv_resting_sessions",
    ):
        if getattr(config, name) < 0:
            raise ConfigError(f"{name} must be >= 0, got {getattr(config, name)}")
    if config.sink < 0:
        raise ConfigError(f"sink must be >= 0, got {config.sink}")
    try:
        config.proposer_options()
        config.compressor()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if not 0 <= config.batch_wait_ms <= 1000:
        raise ConfigError(f"batch_wait_ms must be in 0..1000, got {config.batch_wait_ms}")
    if config.shutdown_grace_s < 0:
        raise ConfigError(f"shutdown_grace_s must be >= 0, got {config.shutdown_grace_s}")
    if not 0 <= config.port <= 65535:
        raise ConfigError(f"port must be in 0..65535, got {config.port}")
    if not -1 <= config.metrics_port <= 65535:
        raise ConfigError(f"metrics_port must be in -1..65535, got {config.metrics_port}")
    if not -1 <= config.http_port <= 65535:
        raise ConfigError(f"http_port must be in -1..65535, got {config.http_port}")
    if config.torch_forward != "auto" and config.backend != "torch":
        raise ConfigError(f"torch_forward {config.torch_forward} applies to the torch backend, not {config.backend}")
    if config.compile != "auto" and config.backend != "torch":
        raise ConfigError(f"compile {config.compile} applies to the torch backend, not {config.backend}")
    if config.kv_dtype == "bfloat16" and (config.backend != "torch" or config.torch_forward == "library"):
        where = config.backend if config.backend != "torch" else "torch_forward library"
        raise ConfigError(f"kv_dtype bfloat16 needs torch's direct forward, not {where}")
    if config.mlx_blas != "auto" and config.backend != "mlx":
        raise ConfigError(f"mlx_blas {config.mlx_blas} applies to the mlx backend, not {config.backend}")
    if not config.mlx_blas:
        raise ConfigError(f"mlx_blas must be one of {', '.join(MLX_BLAS_CHOICES)} or a library path")
    if bool(config.tls_cert) != bool(config.tls_key):
        raise ConfigError("tls_cert and tls_key must be given together")
    if config.journal_url and config.state_dir:
        raise ConfigError("journal_url and state_dir are two places for one journal: give one of them")
    if config.journal_url and not config.journal_url.startswith(("postgresql://", "postgres://")):
        raise ConfigError("journal_url must be a postgresql:// URL")
    if not config.api_key and not is_loopback(config.host):
        raise ConfigError(
            f"refusing to bind non-loopback address {config.host!r} without an API key "
            f"(set --api-key or {ENV_PREFIX}API_KEY)"
        )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
