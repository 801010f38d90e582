"""The served model's grammar compiler, built on first use, with its errors mapped to the service's."""

from __future__ import annotations

import threading
from pathlib import Path

from inference_engine.errors import InvalidArgument
from kv_cache_proposer.grammar import GrammarCompiler, GrammarError, GrammarSpec, GrammarState


class ModelGrammars:
    """Compiles the grammars of generations against the model directory's tokenizer.

    The compiler is built on the first grammar request, so a model directory without a tokenizer serves
    everything but grammars; that request (and every later one) gets INVALID_ARGUMENT saying why.
    """

    def __init__(self, model_dir: Path, vocab_size: int, *, cache_size: int) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    def start(self, spec: GrammarSpec) -> tuple[GrammarState, frozenset[int]]:
        """A generation's grammar state and the end-of-sequence ids that end its completed grammar.

        Blocking (compiling can take a while for large grammars): call it off the event loop.
        """
        try:
            compiler = self.compiler()
            return compiler.start(spec), compiler.eos_token_ids
        except GrammarError as exc:
            raise InvalidArgument(f"grammar: {exc}") from None

    def compiler(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler.from_model_dir(
                    self.model_dir, self.vocab_size, cache_size=self.cache_size
                )
            return self._compiler
