"""The arms of `scripts/bench_decode.py`: the daemon through the SDK, the engine in-process and the bare library
loops; on torch, each at one `--weights` choice (how the linear layers are held), the engine and the daemons
also with their decode steps compiled (`--compile on`).

An arm is prepared once per history: it prefills the history (untimed) and decodes its first token. What it
returns decodes `new_tokens` more greedy tokens from a copy of that state, the same state at every call: a fork of
the daemon's session, a clone of the engine's cache, a copy of transformers' cache, mlx-lm's cache trimmed back.
So repeats cost no prefill, and every arm decodes the same tokens after the same history.
"""

from __future__ import annotations

import argparse
import copy
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lib.corpus import read_text, split_sources, stdlib_sources
from lib.daemon import Daemon

Decoding = Callable[[int], dict[str, Any]]
"""Decodes that many greedy tokens from one prefilled state (the same at every call): tokens and their timing."""
Arm = Callable[[list[int]], Decoding]
"""Prefills a history, untimed, and returns its decoding."""
Prefill = Callable[[list[int]], dict[str, float]]
"""Times a fresh prefill of a history to its first token."""

_COMPILE_S = re.compile(r'"compile_s": ([0-9.]+)')


def history_tokens(model: Path, length: int) -> list[int]:
    """`length` tokens of held-out standard-library source, the same text for every arm."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    ids: list[int] = []
    for path in split_sources(stdlib_sources())[1]:
        ids += tokenizer.encode(read_text(path))
        if len(ids) >= length:
            return ids[:length]
    raise RuntimeError(f"the held-out corpus has fewer than {length} tokens")


def timed_tokens(stream: Iterator[int], started: float) -> dict[str, Any]:
    """Consume a token stream, timing the first and the last token."""
    tokens: list[int] = []
    first = started
    for token in stream:
        if not tokens:
            first = time.perf_counter()
        tokens.append(int(token))
    last = time.perf_counter()
    return {
        "tokens": tokens,
        "ttft_s": first - started,
        "decode_tokens_per_s": (len(tokens) - 1) / (last - first) if last > first else float("nan"),
    }


# -- torch arms ----------------------------------------------------------------------------------------------------
def torch_arms(args: argparse.Namespace, weights: str = "float32") -> tuple[dict[str, Arm], Prefill, Any]:
    """The engine, the bare loop and `generate` over one verifier whose linear layers are held as `weights`: the
    bare loops call its transformers modules, whose linear layers are the verifier's own packed ones."""
    import torch
    from transformers import DynamicCache
    from transformers.generation.streamers import BaseStreamer

    from kv_cache_proposer.backends import load_verifier
    from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier

    torch.set_num_threads(args.threads)
    verifier = load_verifier("torch", args.model, device=args.device, dtype="float32", weights=weights)
    assert isinstance(verifier, TorchVerifier)
    model = verifier.model
    device = verifier.device

    def ids(tokens: list[int]) -> Any:
        return torch.tensor([tokens], device=device)  # [1, n]

    @torch.inference_mode()
    def prefilled(history: list[int]) -> tuple[Any, int]:
        """transformers' cache holding `history`, and the greedy token after it."""
        cache = DynamicCache()
        logits = model(input_ids=ids(history), past_key_values=cache, use_cache=True, logits_to_keep=1)
        return cache, int(logits.logits[0, -1].argmax())

    def bare_loop(history: list[int]) -> Decoding:
        held, first = prefilled(history)

        @torch.inference_mode()
        def decode(new_tokens: int) -> dict[str, Any]:
            cache = copy.deepcopy(held)

            def stream() -> Iterator[int]:
                token = first
                for _ in range(new_tokens):
                    step = model(input_ids=ids([token]), past_key_values=cache, use_cache=True, logits_to_keep=1)
                    token = int(step.logits[0, -1].argmax())
                    yield token

            return timed_tokens(stream(), time.perf_counter())

        return decode

    class _Times(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.calls = 0

        def put(self, value: Any) -> None:
            self.calls += 1
            if self.calls > 1:  # the first call is the prompt
                self.times.append(time.perf_counter())

        def end(self) -> None:
            return None

    def generate(history: list[int]) -> Decoding:
        held, first = prefilled(history)
        prompt = ids([*history, first])  # the cache holds all but the last token

        @torch.inference_mode()
        def decode(new_tokens: int) -> dict[str, Any]:
            streamer = _Times()
            started = time.perf_counter()
            out = model.generate(  # type: ignore[operator]
                prompt,
                attention_mask=torch.ones_like(prompt),
                past_key_values=copy.deepcopy(held),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                streamer=streamer,
            )
            times = streamer.times
            return {
                "tokens": out[0, prompt.shape[1] :].tolist(),
                "ttft_s": times[0] - started,
                "decode_tokens_per_s": (len(times) - 1) / (times[-1] - times[0]),
            }

        return decode

    @torch.inference_mode()
    def bare_prefill(history: list[int]) -> dict[str, float]:
        started = time.perf_counter()
        logits = model(input_ids=ids(history), past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
        int(logits.logits[0, -1].argmax())  # waits for the device
        return {"prefill_s": time.perf_counter() - started}

    return {"engine": engine_arm(verifier), "bare_loop": bare_loop, "generate": generate}, bare_prefill, verifier


def compiled_engine(verifier: Any) -> tuple[Arm, float]:
    """The engine over `verifier`'s model with its decode steps compiled (`--compile on`), and the seconds
    compiling took."""
    from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier

    compiled = TorchVerifier(
        verifier.model, device=verifier.device, dtype=verifier.dtype, compile="on", weights=verifier.weights
    )
    if compiled.compile_s is None:
        raise RuntimeError(f"compiling the decode step failed: {compiled.description} (the log says why)")
    return engine_arm(compiled), compiled.compile_s


# -- mlx arms ------------------------------------------------------------------------------------------------------
def mlx_arms(args: argparse.Namespace) -> tuple[dict[str, Arm], Prefill, Any]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    from kv_cache_proposer.backends import load_verifier
    from kv_cache_proposer.backends.mlx_backend.verifier import MlxVerifier

    verifier = load_verifier("mlx", args.model, device="cpu", dtype="float32")  # input-major, as the daemon's
    assert isinstance(verifier, MlxVerifier)
    model = MlxVerifier.load(args.model, device="cpu", dtype="float32", input_major=False).model  # as mlx-lm lays it

    def greedy(logits: mx.array) -> mx.array:
        return mx.argmax(logits, axis=-1)

    def mlx_lm_over(served: Any) -> Arm:
        def mlx_lm(history: list[int]) -> Decoding:
            cache = make_prompt_cache(served)
            (first,) = [
                int(t)
                for t, _ in generate_step(mx.array(history), served, max_tokens=1, sampler=greedy, prompt_cache=cache)
            ]

            def trim() -> None:  # the loop stages one step ahead: back to the history alone
                mx.eval([layer.state for layer in cache])
                trim_prompt_cache(cache, cache[0].offset - len(history))

            trim()

            def decode(new_tokens: int) -> dict[str, Any]:
                steps = generate_step(
                    mx.array([first]), served, max_tokens=new_tokens, sampler=greedy, prompt_cache=cache
                )
                result = timed_tokens((int(token) for token, _ in steps), time.perf_counter())
                trim()
                return result

            return decode

        return mlx_lm

    def bare_prefill(history: list[int]) -> dict[str, float]:
        started = time.perf_counter()
        logits = model(mx.array([history]), cache=make_prompt_cache(model))[:, -1]
        mx.eval(logits)
        return {"prefill_s": time.perf_counter() - started}

    arms = {
        "engine": engine_arm(verifier),
        **{f"engine:burst{burst}": engine_arm(verifier, burst=burst) for burst in args.mlx_engine_bursts},
        "mlx_lm": mlx_lm_over(model),
        "mlx_lm:input_major": mlx_lm_over(verifier.model),
    }
    return arms, bare_prefill, verifier


# -- engine arms ---------------------------------------------------------------------------------------------------
def _first_token(verifier: Any, history: list[int], chunk: int | None = None, burst: int | None = None) -> Any:
    """A decoder (prefill chunks of `chunk` tokens, decode bursts of `burst` steps; None: the daemon's defaults)
    and a sequence that holds `history` and the first token after it."""
    from kv_cache_proposer.decoding import Decoder, GenerationBudget, SequenceState
    from kv_cache_proposer.sampling import SamplingParams
    from kv_cache_proposer.strategies import FullStrategy

    decoder = Decoder(verifier, prefill_chunk_tokens=chunk, burst_tokens=burst)
    seq = SequenceState(cache=verifier.new_cache(FullStrategy()), tokens=list(history))
    while len(seq.tokens) == len(history):
        decoder.step(seq, SamplingParams(), GenerationBudget(max_new_tokens=1), 0)
    return decoder, seq


def engine_arm(verifier: Any, burst: int | None = None) -> Arm:
    """`Decoder.step` in-process, decoding in bursts of `burst` steps (None: the daemon's default)."""
    from kv_cache_proposer.decoding import GenerationBudget, SequenceState
    from kv_cache_proposer.sampling import SamplingParams

    def engine(history: list[int]) -> Decoding:
        decoder, held = _first_token(verifier, history, burst=burst)

        def decode(new_tokens: int) -> dict[str, Any]:
            seq = SequenceState(
                cache=held.cache.clone(held.committed), tokens=list(held.tokens), committed=held.committed
            )
            budget, params = GenerationBudget(max_new_tokens=new_tokens), SamplingParams()

            def stream() -> Iterator[int]:
                produced = 0
                while produced < new_tokens:
                    step = decoder.step(seq, params, budget, produced)
                    produced += len(step.tokens)
                    yield from step.tokens

            try:
                return timed_tokens(stream(), time.perf_counter())
            finally:
                seq.cache.release()

        return decode

    return engine


def engine_prefill(verifier: Any, chunk: int | None = None) -> Prefill:
    """A fresh sequence's prefill to its first token in chunks of `chunk` tokens (None: the daemon's default)."""

    def prefill(history: list[int]) -> dict[str, float]:
        started = time.perf_counter()
        _first_token(verifier, history, chunk=chunk)
        return {"prefill_s": time.perf_counter() - started}

    return prefill


# -- daemon arms ---------------------------------------------------------------------------------------------------
class DaemonArm:
    """A daemon serving the model with one backend and proposer, driven through the Python SDK: prepared, it holds
    one session with the history and its first token, and every decoding runs on a fork of it.

    On torch the daemon holds its linear layers as `weights`, always named on its command line (its own default,
    auto, would choose int4 for a 4-bit GGUF model); MLX daemons take no choice and run float32."""

    def __init__(
        self,
        backend: str,
        proposer: str,
        args: argparse.Namespace,
        *,
        weights: str = "float32",
        compiled: bool = False,
        blas: str | None = None,
    ) -> None:
        import kakeya

        device = args.device if backend == "torch" else "cpu"
        flags = ["--model", str(args.model), "--backend", backend, "--device", device, "--dtype", "float32"]
        proposer, _, policy = proposer.partition("/")  # "dflash/cost": the proposer under that draft policy
        flags += ["--proposer", proposer, "--kv-strategy", "full", "--threads", str(args.threads)]
        if policy:
            flags += ["--draft-policy", policy]
        if backend == "torch":
            flags += ["--weights", weights, "--compile", "on" if compiled else "off"]
        elif weights != "float32" or compiled:
            raise ValueError("the MLX daemon arms run float32 weights, uncompiled")
        if backend == "mlx":
            flags += ["--mlx-blas", blas or args.mlx_blas]
        self.daemon = Daemon(flags)
        self.client = kakeya.Client(self.daemon.wait_listening())
        self._held: Any = None
        # what the daemon logged compiling its decode step, when it did
        self.compile_s = next((float(m.group(1)) for m in map(_COMPILE_S.search, self.daemon.lines) if m), None)
        if compiled and self.compile_s is None:
            self.close()
            raise RuntimeError("the daemon did not compile its decode step:\n" + "\n".join(self.daemon.lines[-30:]))

    def __call__(self, history: list[int]) -> Decoding:
        self._release()
        held = self._held = self.client.create_session(initial_tokens=history, eos_token_ids=[])
        list(held.generate(1))

        def decode(new_tokens: int) -> dict[str, Any]:
            with held.fork() as session:
                stream = session.generate(new_tokens)
                result = timed_tokens(stream, time.perf_counter())
                stats = stream.stats
            if stats is not None:
                result["forwards"] = stats.verifier_forward_count
            return result

        return decode

    def prefill(self, history: list[int]) -> dict[str, float]:
        """An append of `history` to a fresh session, prefilled by a one-token generation: the daemon's own
        prefill seconds and the time to the first token."""
        with self.client.create_session(initial_tokens=history, eos_token_ids=[]) as session:
            stream = session.generate(1)
            result = timed_tokens(stream, time.perf_counter())
            stats = stream.stats
        return {
            "prefill_s": stats.prefill_duration_s if stats is not None else result["ttft_s"],
            "ttft_s": result["ttft_s"],
        }

    def _release(self) -> None:
        if self._held is not None:
            self._held.close()
            self._held = None

    def close(self) -> None:
        self._release()
        self.client.close()
        self.daemon.stop()
