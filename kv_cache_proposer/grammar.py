"""Grammar-constrained decoding through llguidance: compiled grammars per model, and one matcher per generation.

A `GrammarCompiler` belongs to one model: it wraps the model's tokenizer (its `tokenizer.json`) as llguidance
sees it, compiles JSON schemas, regular expressions and context-free grammars (Lark, or GBNF translated to Lark)
into matchers, and keeps the compiled matchers in an LRU cache keyed by the grammar. A generation gets a copy of
the cached matcher (`GrammarState`), which follows the generation's committed tokens only: speculative drafts are
checked and masked by consuming them on the matcher and rolling them back before anything is committed.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

from kv_cache_proposer.errors import EngineError


class GrammarKind(Enum):
    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    LARK = "lark"
    GBNF = "gbnf"


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What the generated tokens must spell: a grammar of one kind, as its source text."""

    kind: GrammarKind
    source: str


class GrammarError(EngineError):
    """A grammar does not compile, or the model has no tokenizer to constrain against."""


class GrammarCompiler:
    """Compiles grammars against one model's tokenizer and caches the compiled matchers (LRU).

    `vocab_size` is the width of the model's logits; the tokenizer may know fewer tokens (padding rows of the
    embedding), never more. `eos_token_ids` are the tokens that end a completed grammar.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int], *, cache_size: int) -> None:
        if not eos_token_ids:
            raise GrammarError("grammar-constrained decoding needs the model's end-of-sequence token id")
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        try:
            self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        except (ValueError, RuntimeError) as exc:
            raise GrammarError(f"the model's tokenizer cannot drive a grammar: {exc}") from exc
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.cache_size = cache_size
        self._cache: OrderedDict[GrammarSpec, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.compiled_count = 0  # grammars compiled (cache misses), for tests and metrics

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, vocab_size: int, *, cache_size: int = 32) -> GrammarCompiler:
        """The compiler of a model directory holding `tokenizer.json`; the end-of-sequence ids come from
        `generation_config.json`, `config.json` or the tokenizer's `eos_token`, in that order."""
        path = Path(model_dir)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise GrammarError(f"{path} has no tokenizer.json: grammar-constrained decoding needs the tokenizer")
        tokenizer_json = tokenizer_file.read_text()
        return cls(tokenizer_json, vocab_size, _eos_token_ids(path, tokenizer_json), cache_size=cache_size)

    def start(self, spec: GrammarSpec) -> GrammarState:
        """A fresh matcher for one generation (compiled on first use of the grammar, then copied from the cache)."""
        with self._lock:
            template = self._cache.get(spec)
            if template is not None:
                self._cache.move_to_end(spec)
            else:
                template = self._compile(spec)
                self._cache[spec] = template
                if len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            return GrammarState(template, self.vocab_size, self.eos_token_ids)

    def _compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        try:
            grammar = _llguidance_grammar(spec)
        except (ValueError, RuntimeError, GbnfToLarkError) as exc:
            raise GrammarError(f"the {spec.kind.value} grammar does not compile: {exc}") from exc
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the {spec.kind.value} grammar does not compile: {matcher.get_error()}")
        self.compiled_count += 1
        return matcher


class GrammarState:
    """One generation's position in its grammar. It advances only on committed tokens."""

    def __init__(self, compiled: llguidance.LLMatcher, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._compiled = compiled  # the cache's pristine matcher, never advanced
        self._matcher = compiled.deep_copy()
        self._committed: list[int] = []
        self._vocab_size = vocab_size
        self._eos = np.array(sorted(eos_token_ids), dtype=np.int64)
        self._words = (vocab_size + 31) // 32

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` the grammar accepts from the committed state (a draft is cut there)."""
        if not tokens:
            return 0
        return int(self._matcher.validate_tokens(list(tokens)))

    def masks_along(self, draft: Sequence[int]) -> np.ndarray:
        """Allowed tokens [len(draft) + 1, vocab] after each prefix `draft[:i]` of a grammar-valid draft.

        A row with no allowed token is a dead end: the grammar cannot go on, yet its sentence is incomplete
        (llguidance then offers only end-of-sequence, which would end an invalid output as if it were complete).
        The draft is consumed to reach each state and rolled back afterwards: the committed state is unchanged.
        """
        bitmask = np.empty((len(draft) + 1, self._words), dtype=np.int32)  # 32 tokens per word
        incomplete = np.zeros(len(draft) + 1, dtype=bool)
        consumed = 0
        try:
            for i in range(len(draft) + 1):
                self._fill(bitmask, i)
                incomplete[i] = not self._matcher.is_accepting()
                if i < len(draft):
                    if not self._matcher.consume_token(int(draft[i])):
                        raise EngineError(f"the grammar rejected draft token {draft[i]} it had validated")
                    consumed += 1
        finally:
            if self._matcher.is_error():
                # Computing the mask of a dead end leaves llguidance's matcher in an error state that a rollback
                # does not clear; the committed state is rebuilt from the committed tokens.
                self._matcher = self._compiled.deep_copy()
                for token in self._committed:
                    self._matcher.consume_token(token)
            elif consumed:
                self._matcher.rollback(consumed)
        bits = np.unpackbits(bitmask.view(np.uint8), axis=-1, bitorder="little")  # [rows, 32 * words]
        allowed = bits[:, : self._vocab_size].astype(bool)  # [rows, V]
        only_eos = allowed.sum(axis=-1) == allowed[:, self._eos].sum(axis=-1)
        allowed[only_eos & incomplete] = False
        return allowed

    def advance(self, tokens: Sequence[int]) -> None:
        """Commit generated tokens: the grammar state moves past them."""
        # One at a time: llguidance's batch consume refuses the end-of-sequence token after a completed grammar.
        for token in tokens:
            if not self._matcher.consume_token(int(token)):
                raise EngineError(f"the grammar rejected committed token {token}: {self._matcher.get_error()}")
            self._committed.append(int(token))

    @property
    def accepting(self) -> bool:
        """Whether the committed tokens form a complete sentence of the grammar."""
        return bool(self._matcher.is_accepting())

    def _fill(self, bitmask: np.ndarray, row: int) -> None:
        target = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(target.ctypes.data, target.size * target.itemsize)


_JSON_DEFAULTS: Any = {"whitespace_flexible": False}


def _llguidance_grammar(spec: GrammarSpec) -> str:
    if spec.kind is GrammarKind.JSON_SCHEMA:
        try:
            schema = json.loads(spec.source)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the schema is not JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise ValueError("a JSON schema must be an object or a boolean")
        # Compact separators unless the schema's own "x-guidance" options say otherwise: with free whitespace a
        # weak model can fill a document with blank lines until max_tokens.
        return str(llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=_JSON_DEFAULTS))
    if spec.kind is GrammarKind.REGEX:
        return str(llguidance.LLMatcher.grammar_from_regex(spec.source))
    if spec.kind is GrammarKind.LARK:
        return str(llguidance.LLMatcher.grammar_from_lark(spec.source))
    return str(llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(spec.source)))


def _eos_token_ids(model_dir: Path, tokenizer_json: str) -> list[int]:
    for name in ("generation_config.json", "config.json"):
        config = _read_json(model_dir / name)
        ids = config.get("eos_token_id") if isinstance(config, dict) else None
        if isinstance(ids, int):
            return [ids]
        if isinstance(ids, list) and ids:
            return [int(i) for i in ids]
    tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
    eos = tokenizer_config.get("eos_token") if isinstance(tokenizer_config, dict) else None
    if isinstance(eos, dict):
        eos = eos.get("content")
    added = json.loads(tokenizer_json).get("added_tokens", [])
    return [int(token["id"]) for token in added if eos is not None and token.get("content") == eos]


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
