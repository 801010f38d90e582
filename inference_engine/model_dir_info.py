"""What the served model says about itself, read from its directory: end-of-sequence ids, the context length it was
trained for and its chat template (`GetModelInfo` reports these, and sessions created without `eos_token_ids` stop
on the model's end-of-sequence ids), and the DFlash drafter it ships."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inference_engine.model_source import model_name
from kv_cache_proposer.restoration import find_plan

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelDirInfo:
    """What one model directory declares: its name, end-of-sequence ids, trained context, chat template and
    restoration plan; empty or zero where the directory does not say."""

    name: str
    eos_token_ids: tuple[int, ...] = ()
    trained_context_tokens: int = 0
    chat_template: str | None = None
    restore_plan: Path | None = None  # the restoration plan manifest the directory ships, if any

    def eos_within(self, vocab_size: int) -> tuple[int, ...]:
        """The end-of-sequence ids inside a vocabulary of `vocab_size`; any outside it are ignored, with a warning."""
        inside = tuple(t for t in self.eos_token_ids if 0 <= t < vocab_size)
        if inside != self.eos_token_ids:
            log.warning(
                "end-of-sequence ids outside the vocabulary are ignored",
                extra={"eos_token_ids": list(self.eos_token_ids), "vocab_size": vocab_size},
            )
        return inside

    @classmethod
    def read(cls, model_dir: Path) -> ModelDirInfo:
        """Read `generation_config.json`, `config.json` and the tokenizer's chat template of `model_dir`.

        The generation config wins for end-of-sequence ids because `transformers` and `mlx-lm` stop on it.
        """
        config = _json(model_dir / "config.json")
        nested = config.get("text_config")
        text_config: dict[str, Any] = nested if isinstance(nested, dict) else config
        generation = _json(model_dir / "generation_config.json")
        eos = _token_ids(generation.get("eos_token_id"))
        if not eos:
            eos = _token_ids(config.get("eos_token_id")) or _token_ids(text_config.get("eos_token_id"))
        context = text_config.get("max_position_embeddings") or config.get("max_position_embeddings") or 0
        return cls(
            name=model_name(model_dir),
            eos_token_ids=eos,
            trained_context_tokens=int(context) if isinstance(context, int) else 0,
            chat_template=_chat_template(model_dir),
            restore_plan=find_plan(model_dir),
        )


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _token_ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, bool):
        return ()
    if isinstance(value, int):
        return (value,) if value >= 0 else ()
    if isinstance(value, list):
        ids: list[int] = []
        for item in value:
            if isinstance(item, int) and not isinstance(item, bool) and item >= 0 and item not in ids:
                ids.append(item)
        return tuple(ids)
    return ()


def _chat_template(model_dir: Path) -> str | None:
    """The template as `transformers` finds it: `chat_template.jinja`, else `tokenizer_config.json`'s entry."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = _json(model_dir / "tokenizer_config.json").get("chat_template")
    if isinstance(template, str) and template:
        return template
    if isinstance(template, list):
        # Several named templates: the default one is what apply_chat_template renders.
        for entry in template:
            if isinstance(entry, dict) and entry.get("name") == "default" and isinstance(entry.get("template"), str):
                return str(entry["template"])
    return None


def model_drafter(model_dir: Path) -> Path | None:
    """The DFlash drafter a model directory ships in its `dflash/` subdirectory (the bundled model does)."""
    drafter = model_dir / "dflash"
    return drafter if (drafter / "config.json").is_file() else None
