"""Checks of what clients send: token ids against the vocabulary, the request limits, sampling parameters and
KV strategy choices. Each failure is a typed error naming the field."""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterable

from inference_engine.config import ServerConfig
from inference_engine.domain import CreateParams, GenerateParams
from inference_engine.errors import InvalidArgument, ResourceExhausted
from kv_cache_proposer.compression import KVCompressor
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import KVStrategy, make_strategy, strategy_options


class RequestChecks:
    """Validation of requests against one server configuration and one model's vocabulary."""

    def __init__(self, config: ServerConfig, vocab_size: int) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self.default_strategy = make_strategy(config.kv_strategy, sink=config.sink, window=config.window)

    def strategy(self, params: CreateParams) -> KVStrategy:
        """The KV strategy a new session asks for, its options filled from the server defaults."""
        name = params.kv_strategy or self.default_strategy.name
        given = {key: value for key, value in (("sink", params.sink), ("window", params.window)) if value is not None}
        try:
            defaults = strategy_options(make_strategy(name, sink=self.config.sink, window=self.config.window))
            foreign = sorted(set(given) - set(defaults))
            if foreign:
                fields = " and ".join(f"{key}_tokens" for key in foreign)
                raise InvalidArgument(f"{fields} do not apply to the {name} strategy")
            return make_strategy(name, **{**defaults, **given})
        except ValueError as exc:
            raise InvalidArgument(f"{name}: {exc}") from None

    def compressor(self, params: CreateParams) -> KVCompressor:
        """The KV compressor a new session asks for; an unset name or Q takes the server default."""
        default = self.config.compressor()
        name = params.kv_compressor or default.name
        q_range = params.kv_q_range if params.kv_q_range is not None else default.q_range
        if name == "none" and params.kv_q_range is not None:
            raise InvalidArgument("kv_q_range does not apply to the none compressor")
        try:
            return KVCompressor(name, q_range)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None

    def tokens(self, token_ids: Iterable[int], what: str) -> list[int]:
        """Token ids as ints, each inside the vocabulary."""
        tokens = [int(t) for t in token_ids]
        vocab = self.vocab_size
        for index, token in enumerate(tokens):
            if not 0 <= token < vocab:
                raise InvalidArgument(f"{what}[{index}] = {token} is outside the vocabulary [0, {vocab})")
        return tokens

    def append(self, history: int, token_ids: Iterable[int], what: str) -> list[int]:
        """Tokens appended to a history of `history` tokens, within the append and history limits."""
        tokens = list(token_ids)
        if len(tokens) > self.config.max_append_tokens:
            raise ResourceExhausted(
                f"{what} carries {len(tokens)} tokens, above the --max-append-tokens limit "
                f"{self.config.max_append_tokens}"
            )
        if history + len(tokens) > self.config.max_history_tokens:
            raise ResourceExhausted(
                f"appending {len(tokens)} tokens to a history of {history} exceeds the --max-history-tokens limit "
                f"{self.config.max_history_tokens}"
            )
        return self.tokens(tokens, what)

    def generate(self, params: GenerateParams) -> tuple[SamplingParams, frozenset[int]]:
        """Sampling parameters and extra stop ids of a generation request."""
        limit = self.config.max_generate_tokens
        if not 1 <= params.max_tokens <= limit:
            raise InvalidArgument(f"max_tokens must be in 1..{limit}, got {params.max_tokens}")
        temperature = 0.0 if params.temperature is None else float(params.temperature)
        if not math.isfinite(temperature) or temperature < 0:
            raise InvalidArgument(f"temperature must be finite and >= 0, got {temperature}")
        top_p = 1.0 if params.top_p is None else float(params.top_p)
        if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
            raise InvalidArgument(f"top_p must be in (0, 1], got {top_p}")
        top_k = 0 if params.top_k is None else int(params.top_k)
        if top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0, got {top_k}")
        seed = secrets.randbits(64) if params.seed is None else int(params.seed)
        if not 0 <= seed < 1 << 64:
            raise InvalidArgument(f"seed must fit in 64 bits, got {seed}")
        stops = self.tokens(params.stop_token_ids, "stop_token_ids")
        sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        return sampling, frozenset(stops)
