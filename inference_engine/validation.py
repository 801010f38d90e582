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
from kv_cache_proposer.controls import DEFAULT_PENALTY_WINDOW_TOKENS, DecodeControls, Penalties
from kv_cache_proposer.decoding import GenerationBudget
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
            strategy = make_strategy(name, **{**defaults, **given})
        except ValueError as exc:
            raise InvalidArgument(f"{name}: {exc}") from None
        # Resident slots are allocated up front: a bound beyond any history this server accepts only reserves
        # memory no session can use.
        limit = self.config.max_history_tokens
        if given and (strategy.bounded_slots or 0) > limit:
            bound = strategy.bounded_slots
            raise InvalidArgument(
                f"sink_tokens + window_tokens = {bound} is above the --max-history-tokens limit {limit}"
            )
        return strategy

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
        min_p = 0.0 if params.min_p is None else float(params.min_p)
        if not (math.isfinite(min_p) and 0.0 <= min_p <= 1.0):
            raise InvalidArgument(f"min_p must be in [0, 1], got {min_p}")
        stops = self.tokens(params.stop_token_ids, "stop_token_ids")
        sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, min_p=min_p)
        return sampling, frozenset(stops)

    def controls(self, params: GenerateParams) -> DecodeControls:
        """A generation's penalties, stop sequences and log-probabilities (its grammar is compiled apart)."""
        return DecodeControls(
            penalties=self.penalties(params),
            stop_sequences=self.stop_sequences(params),
            top_logprobs=self.top_logprobs(params),
        )

    def budget(self, history: int, params: GenerateParams, stop_token_ids: frozenset[int]) -> GenerationBudget:
        """The limits of a generation over a history of `history` tokens; refused on an empty history or one at
        the history limit."""
        if not history:
            raise InvalidArgument("the session history is empty: append tokens before generating")
        if history >= self.config.max_history_tokens:
            raise ResourceExhausted(f"the session holds {history} tokens, the --max-history-tokens limit")
        return GenerationBudget(
            max_new_tokens=params.max_tokens,
            stop_token_ids=stop_token_ids,
            max_history_tokens=self.config.max_history_tokens,
        )

    def stop_sequences(self, params: GenerateParams) -> tuple[tuple[int, ...], ...]:
        """The generation's stop sequences: within the count and length limits, every id in the vocabulary."""
        sequences = params.stop_sequences
        if len(sequences) > self.config.max_stop_sequences:
            raise InvalidArgument(
                f"stop_sequences holds {len(sequences)} sequences, above the limit {self.config.max_stop_sequences}"
            )
        out = []
        for index, sequence in enumerate(sequences):
            if not 1 <= len(sequence) <= self.config.max_stop_sequence_tokens:
                raise InvalidArgument(
                    f"stop_sequences[{index}] holds {len(sequence)} tokens; a stop sequence holds 1.."
                    f"{self.config.max_stop_sequence_tokens}"
                )
            out.append(tuple(self.tokens(sequence, f"stop_sequences[{index}].token_ids")))
        return tuple(out)

    def top_logprobs(self, params: GenerateParams) -> int | None:
        """How many alternatives to report per token, or None when the generation asks for no log-probabilities."""
        limit = self.config.max_top_logprobs
        if params.top_logprobs and not params.logprobs:
            raise InvalidArgument("top_logprobs needs logprobs")
        if not 0 <= params.top_logprobs <= limit:
            raise InvalidArgument(f"top_logprobs must be in 0..{limit}, got {params.top_logprobs}")
        return params.top_logprobs if params.logprobs else None

    def penalties(self, params: GenerateParams) -> Penalties:
        """Repetition, presence and frequency penalties and their history window."""
        repetition = 1.0 if params.repetition_penalty is None else float(params.repetition_penalty)
        if not (math.isfinite(repetition) and repetition > 0):
            raise InvalidArgument(f"repetition_penalty must be finite and > 0, got {repetition}")
        presence = 0.0 if params.presence_penalty is None else float(params.presence_penalty)
        frequency = 0.0 if params.frequency_penalty is None else float(params.frequency_penalty)
        for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
            if not math.isfinite(value):
                raise InvalidArgument(f"{name} must be finite, got {value}")
        limit = self.config.max_history_tokens
        # The default window never exceeds the history limit; an explicit one must not either.
        window = min(DEFAULT_PENALTY_WINDOW_TOKENS, limit)
        if params.penalty_window_tokens is not None:
            window = int(params.penalty_window_tokens)
            if not 1 <= window <= limit:
                raise InvalidArgument(f"penalty_window_tokens must be in 1..{limit}, got {window}")
        return Penalties(repetition=repetition, presence=presence, frequency=frequency, window_tokens=window)
