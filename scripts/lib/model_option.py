"""`--model` of the scripts, taken as `kakeya-runtime serve --model` takes it: a model name, a model directory or a
GGUF file, resolved through `inference_engine.model_source` into the model directory a script loads.

The parsed arguments hold the directory in `model` (what the script loads, or passes to a daemon it starts) and the
value given in `model_name` (`smollm2-135m-instruct`, `kakeya-tiny`, a path), so a results file names the model, not
only a cache directory. The scripts default to `kakeya-tiny`, the bundled tiny model.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

from inference_engine.model_source import BUNDLED_MODEL_DIR, MODEL_NAMES, ModelSourceError, resolve_model

SCRIPT_DEFAULT_MODEL = "kakeya-tiny"
# As the daemon's --model-cache-dir: where GGUF conversions are cached (empty: the default cache).
CACHE_DIR_VARIABLE = "KAKEYA_MODEL_CACHE_DIR"
MODEL_HELP = (
    f"as `kakeya-runtime serve --model` takes it: a model name ({', '.join(MODEL_NAMES)}), a model directory, or a "
    f"GGUF file (converted once into the daemon's model cache; ${CACHE_DIR_VARIABLE} names another); default: "
    f"{SCRIPT_DEFAULT_MODEL} (%(default)s)"
)


class _ResolveModel(argparse.Action):
    """Stores the model directory `values` stands for in `dest`, and `values` itself in `model_name`."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        try:
            resolved = resolve_model(str(values), os.environ.get(CACHE_DIR_VARIABLE, ""))
        except ModelSourceError as exc:
            raise argparse.ArgumentError(self, str(exc)) from None
        setattr(namespace, self.dest, resolved.directory)
        namespace.model_name = resolved.source


def add_model_option(parser: argparse.ArgumentParser, purpose: str = "") -> None:
    """Add `--model` (default: kakeya-tiny) to `parser`; `purpose` says what the script does with it."""
    parser.add_argument(
        "--model",
        action=_ResolveModel,
        default=BUNDLED_MODEL_DIR,
        metavar="NAME|DIR|GGUF",
        help=f"{purpose or 'the model'}, {MODEL_HELP}",
    )
    parser.set_defaults(model_name=SCRIPT_DEFAULT_MODEL)
