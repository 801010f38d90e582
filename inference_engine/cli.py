"""`kakeya-runtime`: the daemon's command line."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import logging
import os
import socket
import sys
from collections.abc import Sequence

from inference_engine import __version__
from inference_engine.config import ConfigError, ServerConfig
from inference_engine.config_sources import env_var, load_config, option_help
from inference_engine.logs import configure_logging
from inference_engine.model_source import DEFAULT_MODEL, ModelSourceError, resolve_model
from inference_engine.threads import apply_threads, on_a_passing_thread, resolve_threads
from kv_cache_proposer.errors import ModelLoadError

log = logging.getLogger("inference_engine")

_DESCRIPTION = """\
Kakeya: a session-bound local LLM inference daemon speaking kakeya.v1 gRPC over raw token ids.

Every option can also be set by a KAKEYA_<OPTION> environment variable or a key in a TOML file
(--config or KAKEYA_CONFIG), e.g. `kv_strategy = "sink_window"`. Precedence: flag > environment >
file > default.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kakeya-runtime", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"kakeya-runtime {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="load a model and serve it",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("--config", metavar="FILE", help=f"TOML file of options (env {env_var('config')})")
    for name, kind, default, text, choices in option_help():
        shown = '""' if default == "" else default
        if name == "api_key":
            shown = "none"
        flag = "--" + name.replace("_", "-")
        serve.add_argument(
            flag,
            dest=name,
            type=kind,
            choices=choices,
            default=None,
            metavar=None if choices else name.upper(),
            help=f"{text} (default: {shown}; env {env_var(name)})",
        )
    prepare = commands.add_parser(
        "prepare-model",
        help="make the model directory a model name or GGUF file stands for, and print its path",
        description="Resolve --model as `serve` does (converting a GGUF file into the model cache once, or "
        "checking and reusing the cached conversion) and print the model directory it loads.",
    )
    prepare.add_argument(
        "--model", default=None, help=f"as serve's --model (default: {DEFAULT_MODEL}; env {env_var('model')})"
    )
    prepare.add_argument(
        "--model-cache-dir",
        default=None,
        help=f"as serve's --model-cache-dir (env {env_var('model_cache_dir')})",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "prepare-model":
        return prepare_model(args.model, args.model_cache_dir)
    if args.command != "serve":
        parser.print_help()
        return 2
    overrides = {name: getattr(args, name) for name, *_ in option_help()}
    try:
        config = load_config(overrides, config_file=args.config)
    except ConfigError as exc:
        parser.exit(2, f"kakeya-runtime: error: {exc}\n")
    configure_logging(config.log_format, config.log_level)
    code = run_server(config)
    # Everything the daemon owns is stopped, journaled and flushed by now; the interpreter's own teardown (freeing
    # the tensor libraries) takes seconds on a busy machine, so leave at once to keep the exit within the grace period.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_server(config: ServerConfig) -> int:
    busy = ports_in_use(config)
    if busy:
        log.error(busy)
        return 1
    threads = resolve_threads(config.threads)
    apply_threads(threads, config.backend)  # before torch loads: OpenMP reads its environment once
    from inference_engine.server import KakeyaServer, load_runtime

    try:
        model = on_a_passing_thread(resolve_model, config.model, config.model_cache_dir)
    except ModelSourceError as exc:
        log.error("cannot serve the model: %s", exc)
        return 2
    changed = config.changed_options()
    config = dataclasses.replace(config, model=str(model.directory))
    log.info(
        "starting kakeya-runtime %s: model %s (%s), backend %s, device %s, dtype %s, %d CPU threads",
        __version__,
        model.source,
        model.directory,
        config.backend,
        config.device,
        config.dtype,
        threads,
        extra={"threads": threads},
    )
    if changed:
        log.info("options: %s", ", ".join(f"{name}={value}" for name, value in changed.items()))
    try:
        runtime = on_a_passing_thread(load_runtime, config)  # the engine thread's OpenMP pool the only one
    except ModelLoadError as exc:
        log.error("cannot load the model: %s", exc)
        return 1
    except ConfigError as exc:  # a setting that does not fit the loaded model (a restoration plan)
        log.error("cannot serve this model: %s", exc)
        return 2
    try:
        asyncio.run(KakeyaServer(runtime).serve_until_signal())
    except (OSError, RuntimeError) as exc:
        log.error("cannot serve: %s", exc)
        return 1
    return 0


def prepare_model(model: str | None, cache_dir: str | None) -> int:
    """`kakeya-runtime prepare-model`: print the model directory, converting a GGUF file first if needed."""
    configure_logging("text", "info")
    try:
        config = load_config({"model": model, "model_cache_dir": cache_dir})
        resolved = resolve_model(config.model, config.model_cache_dir)
    except (ConfigError, ModelSourceError) as exc:
        log.error("cannot prepare the model: %s", exc)
        return 2
    print(resolved.directory)
    return 0


def ports_in_use(config: ServerConfig) -> str | None:
    """A message naming the first configured port something else already listens on, checked before the model
    loads so that a taken port fails in a second, not after the load."""
    wanted = [("gRPC", config.port), ("metrics", config.metrics_port), ("HTTP shim", config.http_port)]
    for what, port in wanted:
        if port <= 0:
            continue
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((config.host.strip("[]"), port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return (
                        f"port {port} is in use on {config.host} (the {what} port); choose another with --"
                        + {
                            "gRPC": "port",
                            "metrics": "metrics-port",
                            "HTTP shim": "http-port",
                        }[what]
                    )
                return f"cannot bind {config.host}:{port} (the {what} port): {exc.strerror}"
    return None


if __name__ == "__main__":
    sys.exit(main())
