"""The arms of `scripts/bench_decode.py`: the daemon through the SDK, the engine in-process and the bare library
loops, each a function of (history, new tokens) returning the tokens and their timing."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lib.corpus import read_text, split_sources, stdlib_sources
from lib.daemon import Daemon

Arm = Callable[[list[int], int], dict[str, Any]]
Prefill = Callable[[list[int]], dict[str, float]]


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
def torch_arms(args: argparse.Namespace) -> tuple[dict[str, Arm], Prefill, Any]:
    import torch
    from transformers import DynamicCache
    from transformers.generation.streamers import BaseStreamer

    from kv_cache_proposer.backends import load_verifier
    from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier

    torch.set_num_threads(args.threads)
    verifier = load_verifier("torch", args.model, device="cpu", dtype="float32")
    assert isinstance(verifier, TorchVerifier)
    model = verifier.model

    @torch.inference_mode()
    def bare_loop(history: list[int], new_tokens: int) -> dict[str, Any]:
        def stream() -> Iterator[int]:
            cache = DynamicCache()
            ids = torch.tensor([history])
            for _ in range(new_tokens):
                logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
                token = int(logits[0, -1].argmax())
                yield token
                ids = torch.tensor([[token]])

        return timed_tokens(stream(), time.perf_counter())

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

    @torch.inference_mode()
    def generate(history: list[int], new_tokens: int) -> dict[str, Any]:
        streamer = _Times()
        started = time.perf_counter()
        out = model.generate(  # type: ignore[operator]
            torch.tensor([history]),
            attention_mask=torch.ones(1, len(history), dtype=torch.long),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            streamer=streamer,
        )
        times = streamer.times
        return {
            "tokens": out[0, len(history) :].tolist(),
            "ttft_s": times[0] - started,
            "decode_tokens_per_s": (len(times) - 1) / (times[-1] - times[0]),
        }

    @torch.inference_mode()
    def bare_prefill(history: list[int]) -> dict[str, float]:
        started = time.perf_counter()
        model(input_ids=torch.tensor([history]), past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
        return {"prefill_s": time.perf_counter() - started}

    return {"engine": engine_arm(verifier), "bare_loop": bare_loop, "generate": generate}, bare_prefill, verifier


# -- mlx arms ------------------------------------------------------------------------------------------------------
def mlx_arms(args: argparse.Namespace) -> tuple[dict[str, Arm], Prefill, Any]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from kv_cache_proposer.backends import load_verifier
    from kv_cache_proposer.backends.mlx_backend.verifier import MlxVerifier

    verifier = load_verifier("mlx", args.model, device="cpu", dtype="float32")  # input-major, as the daemon's
    assert isinstance(verifier, MlxVerifier)
    model = MlxVerifier.load(args.model, device="cpu", dtype="float32", input_major=False).model  # as mlx-lm lays it

    def greedy(logits: mx.array) -> mx.array:
        return mx.argmax(logits, axis=-1)

    def mlx_lm_over(served: Any) -> Arm:
        def mlx_lm(history: list[int], new_tokens: int) -> dict[str, Any]:
            steps = generate_step(mx.array(history), served, max_tokens=new_tokens, sampler=greedy)
            return timed_tokens((int(token) for token, _ in steps), time.perf_counter())

        return mlx_lm

    def bare_prefill(history: list[int]) -> dict[str, float]:
        started = time.perf_counter()
        logits = model(mx.array([history]), cache=make_prompt_cache(model))[:, -1]
        mx.eval(logits)
        return {"prefill_s": time.perf_counter() - started}

    arms = {
        "engine": engine_arm(verifier),
        "engine:burst1": engine_arm(verifier, burst=1),
        "mlx_lm": mlx_lm_over(model),
        "mlx_lm:input_major": mlx_lm_over(verifier.model),
    }
    return arms, bare_prefill, verifier


def engine_arm(verifier: Any, chunk: int | None = None, burst: int | None = None) -> Arm:
    """`Decoder.step` in-process, prefilling in chunks of `chunk` tokens and decoding in bursts of `burst` steps
    (None: the daemon's defaults for this verifier)."""
    from kv_cache_proposer.decoding import Decoder, GenerationBudget, SequenceState
    from kv_cache_proposer.sampling import SamplingParams
    from kv_cache_proposer.strategies import FullStrategy

    def engine(history: list[int], new_tokens: int) -> dict[str, Any]:
        decoder = Decoder(verifier, prefill_chunk_tokens=chunk, burst_tokens=burst)
        seq = SequenceState(cache=verifier.new_cache(FullStrategy()), tokens=list(history))
        budget, params = GenerationBudget(max_new_tokens=new_tokens), SamplingParams()

        def stream() -> Iterator[int]:
            produced = 0
            while produced < new_tokens:
                step = decoder.step(seq, params, budget, produced)
                produced += len(step.tokens)
                yield from step.tokens

        return timed_tokens(stream(), time.perf_counter())

    return engine


# -- daemon arms ---------------------------------------------------------------------------------------------------
class DaemonArm:
    """A daemon serving the model with one backend and proposer, driven through the Python SDK."""

    def __init__(self, backend: str, proposer: str, args: argparse.Namespace) -> None:
        import kakeya

        flags = ["--model", str(args.model), "--backend", backend, "--device", "cpu", "--dtype", "float32"]
        flags += ["--proposer", proposer, "--kv-strategy", "full", "--threads", str(args.threads)]
        self.daemon = Daemon(flags)
        self.client = kakeya.Client(self.daemon.wait_listening())

    def __call__(self, history: list[int], new_tokens: int) -> dict[str, Any]:
        with self.client.create_session(initial_tokens=history, eos_token_ids=[]) as session:
            stream = session.generate(new_tokens)
            result = timed_tokens(stream, time.perf_counter())
            stats = stream.stats
        if stats is not None:
            result["server_prefill_s"] = stats.prefill_duration_s
            result["forwards"] = stats.verifier_forward_count
        return result

    def close(self) -> None:
        self.client.close()
        self.daemon.stop()


def daemon_prefill(arm: DaemonArm, history: list[int]) -> dict[str, float]:
    """An append of `history` to a fresh session, prefilled by a one-token generation."""
    result = arm(history, 2)
    return {"prefill_s": result.get("server_prefill_s", result["ttft_s"]), "ttft_s": result["ttft_s"]}
