"""Decode and prefill speed of the daemon against the bare library loops, side by side in one run.

For every history length the same text (held-out standard-library source tokenized with the model's tokenizer) is
prefilled, then `--new-tokens` greedy tokens are decoded, by each arm:

- both backends: `daemon:<proposer>` (`kakeya-runtime serve` through the Python SDK, one daemon per
  `--daemon-proposers` entry; `none` is plain decoding, `dflash` the bundled drafter) and `engine` (`Decoder.step`
  in-process, no proposer, no gRPC);
- torch: `bare_loop` (the model called token by token with transformers' `DynamicCache`) and `generate`
  (`model.generate` with a streamer timing each token);
- mlx: `mlx_lm` (mlx-lm's own `generate_step`).

Decode rate is (tokens - 1) / (time of the last token - time of the first), so the prefill is not in it. Arms
alternate within each repeat, so machine noise hits them alike; the summary holds medians and every arm's ratio to
the bare loop of its backend (`bare_loop` on torch, `mlx_lm` on MLX), and per arm the per-token decode time at the
longest history over the shortest. The prefill part appends `--prefill-tokens` to a fresh session and times it to the
first token: the daemon (its own prefill seconds), the engine with its chosen chunk, and one bare forward. Greedy
tokens of daemon:none, engine and bare_loop must agree (float32).

Writes `results/bench_decode_<stamp>.json` and a PNG plot next to it.

Usage:
    python scripts/bench_decode.py [--backends torch,mlx] [--histories 1024,8192,32768] [--mlx-histories 1024,8192]
        [--new-tokens 128] [--prefill-tokens 8192] [--repeats 3] [--threads 0] [--daemon-proposers none,dflash]
        [--model DIR] [--out results]
    python scripts/bench_decode.py --smoke    # seconds-long run with tiny sizes (tests)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.corpus import read_text, split_sources, stdlib_sources
from lib.daemon import Daemon
from lib.results import RESULTS_DIR, write_results

from inference_engine.config import BUNDLED_MODEL_DIR

Arm = Callable[[list[int], int], dict[str, Any]]
BARE = {"torch": "bare_loop", "mlx": "mlx_lm"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="torch,mlx", help="comma-separated: torch, mlx (default: both)")
    p.add_argument("--histories", default="1024,8192,32768", help="torch history lengths in tokens")
    p.add_argument("--mlx-histories", default="1024,8192", help="MLX history lengths (its CPU prefill is slow)")
    p.add_argument("--new-tokens", type=int, default=128, help="greedy tokens decoded per run (default: 128)")
    p.add_argument("--prefill-tokens", type=int, default=8192, help="tokens of the timed append (default: 8192)")
    p.add_argument("--repeats", type=int, default=3, help="runs of every arm per history (default: 3)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads of every arm; 0: one per usable core")
    p.add_argument("--daemon-proposers", default="none,dflash", help="one daemon arm per proposer (must hold none)")
    p.add_argument("--model", type=Path, default=BUNDLED_MODEL_DIR, help="checkpoint directory (both backends)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder (default: results/)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, for tests")
    args = p.parse_args(argv)
    if args.smoke:
        args.histories = args.mlx_histories = "48,96"
        args.new_tokens, args.prefill_tokens, args.repeats, args.daemon_proposers = 6, 64, 1, "none"
    args.backends = [b for b in args.backends.split(",") if b]
    args.histories = [int(h) for h in args.histories.split(",") if h]
    args.mlx_histories = [int(h) for h in args.mlx_histories.split(",") if h]
    args.daemon_proposers = [d for d in args.daemon_proposers.split(",") if d]
    if args.threads == 0:
        args.threads = len(os.sched_getaffinity(0))
    unknown = set(args.backends) - set(BARE)
    if unknown:
        p.error(f"unknown backends {sorted(unknown)}")
    if "none" not in args.daemon_proposers:
        p.error("--daemon-proposers must hold none (the prefill arm and the token check use it)")
    if args.new_tokens < 2 or args.repeats < 1 or args.prefill_tokens < 1:
        p.error("--new-tokens >= 2, --repeats >= 1 and --prefill-tokens >= 1 are required")
    return args


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
def torch_arms(args: argparse.Namespace) -> tuple[dict[str, Arm], Callable[[list[int]], dict[str, float]]]:
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

    return {"engine": engine_arm(verifier, args), "bare_loop": bare_loop, "generate": generate}, bare_prefill


# -- mlx arms ------------------------------------------------------------------------------------------------------
def mlx_arms(args: argparse.Namespace) -> tuple[dict[str, Arm], Callable[[list[int]], dict[str, float]]]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from kv_cache_proposer.backends import load_verifier
    from kv_cache_proposer.backends.mlx_backend.verifier import MlxVerifier

    verifier = load_verifier("mlx", args.model, device="cpu", dtype="float32")
    assert isinstance(verifier, MlxVerifier)
    model = verifier.model

    def greedy(logits: mx.array) -> mx.array:
        return mx.argmax(logits, axis=-1)

    def mlx_lm(history: list[int], new_tokens: int) -> dict[str, Any]:
        steps = generate_step(mx.array(history), model, max_tokens=new_tokens, sampler=greedy)
        return timed_tokens((int(token) for token, _ in steps), time.perf_counter())

    def bare_prefill(history: list[int]) -> dict[str, float]:
        started = time.perf_counter()
        logits = model(mx.array([history]), cache=make_prompt_cache(model))[:, -1]
        mx.eval(logits)
        return {"prefill_s": time.perf_counter() - started}

    return {"engine": engine_arm(verifier, args), "mlx_lm": mlx_lm}, bare_prefill


def engine_arm(verifier: Any, args: argparse.Namespace) -> Arm:
    """`Decoder.step` in-process with the daemon's default prefill chunk for this verifier."""
    from kv_cache_proposer.decoding import Decoder, GenerationBudget, SequenceState
    from kv_cache_proposer.sampling import SamplingParams
    from kv_cache_proposer.strategies import FullStrategy

    def engine(history: list[int], new_tokens: int) -> dict[str, Any]:
        decoder = Decoder(verifier)
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


# -- the run -------------------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    samples: dict[str, Any] = {"decode": [], "prefill": []}
    longest = max([*args.histories, *args.mlx_histories, args.prefill_tokens])
    text = history_tokens(args.model, longest)
    for backend in args.backends:
        arms, bare_prefill = torch_arms(args) if backend == "torch" else mlx_arms(args)
        daemons = {f"daemon:{p}": DaemonArm(backend, p, args) for p in args.daemon_proposers}
        try:
            every: dict[str, Arm] = {**daemons, **arms}
            histories = args.histories if backend == "torch" else args.mlx_histories
            for history_len in histories:
                history = text[:history_len]
                for repeat in range(args.repeats):
                    order = list(every) if repeat % 2 == 0 else list(reversed(every))
                    for name in order:
                        result = every[name](history, args.new_tokens)
                        samples["decode"].append({"backend": backend, "arm": name, "history": history_len, **result})
                        print(
                            f"{backend} {name:>14} history {history_len:>6}: "
                            f"{result['decode_tokens_per_s']:7.1f} tok/s, ttft {result['ttft_s']:.3f} s",
                            flush=True,
                        )
            appended = text[: args.prefill_tokens]
            for _ in range(args.repeats):
                for name in ("daemon:none", "engine", "one_forward"):
                    if name == "daemon:none":
                        result = daemon_prefill(daemons[name], appended)
                    elif name == "engine":
                        result = {"prefill_s": arms["engine"](appended, 1)["ttft_s"]}
                    else:
                        result = bare_prefill(appended)
                    samples["prefill"].append({"backend": backend, "arm": name, "tokens": len(appended), **result})
                    print(f"{backend} prefill {name:>12}: {result['prefill_s']:.3f} s", flush=True)
        finally:
            for daemon in daemons.values():
                daemon.close()
    return samples


def summarize(samples: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for backend in args.backends:
        decode = [s for s in samples["decode"] if s["backend"] == backend]
        rates: dict[str, dict[int, float]] = {}
        for sample in decode:
            rates.setdefault(sample["arm"], {}).setdefault(sample["history"], [])  # type: ignore[arg-type]
        for arm, by_history in rates.items():
            for history in by_history:
                values = [s["decode_tokens_per_s"] for s in decode if s["arm"] == arm and s["history"] == history]
                by_history[history] = statistics.median(values)
        bare = rates[BARE[backend]]
        histories = sorted(bare)
        part: dict[str, Any] = {
            "decode_tokens_per_s": {arm: {str(h): round(r, 1) for h, r in v.items()} for arm, v in rates.items()}
        }
        part["decode_ratio_to_bare"] = {
            arm: {str(h): round(v[h] / bare[h], 3) for h in histories} for arm, v in rates.items()
        }
        part["per_token_time_longest_over_shortest"] = {
            arm: round(v[histories[0]] / v[histories[-1]], 3) for arm, v in rates.items()
        }
        part["tokens_agree"] = tokens_agree(decode, backend)
        prefill = [s for s in samples["prefill"] if s["backend"] == backend]
        medians = {
            arm: statistics.median(s["prefill_s"] for s in prefill if s["arm"] == arm)
            for arm in {s["arm"] for s in prefill}
        }
        tokens = args.prefill_tokens
        part["prefill_tokens_per_s"] = {arm: round(tokens / s, 1) for arm, s in medians.items()}
        part["prefill_ratio_to_one_forward"] = {arm: round(medians["one_forward"] / s, 3) for arm, s in medians.items()}
        summary[backend] = part
    return summary


def tokens_agree(decode: list[dict[str, Any]], backend: str) -> bool:
    """Whether the greedy tokens of the daemon without a proposer, the engine and the bare loop agree."""
    compared = {"daemon:none", "engine", BARE[backend]}
    by_history: dict[int, set[tuple[int, ...]]] = {}
    for sample in decode:
        if sample["arm"] in compared:
            by_history.setdefault(sample["history"], set()).add(tuple(sample["tokens"]))
    return all(len(outputs) == 1 for outputs in by_history.values())


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backends = list(summary)
    fig, axes = plt.subplots(1, len(backends) + 1, figsize=(6 * (len(backends) + 1), 4.2), squeeze=False)
    for ax, backend in zip(axes[0], backends, strict=False):
        rates = summary[backend]["decode_tokens_per_s"]
        arms = list(rates)
        histories = list(next(iter(rates.values())))
        width = 0.8 / len(arms)
        for i, arm in enumerate(arms):
            xs = np.arange(len(histories)) + i * width
            ax.bar(xs, [rates[arm][h] for h in histories], width, label=arm)
        ax.set_xticks(np.arange(len(histories)) + 0.4 - width / 2, [f"{int(h):,}" for h in histories])
        ax.set_xlabel("history tokens")
        ax.set_ylabel("decode tokens/s (median)")
        ax.set_title(f"{backend}: decode")
        ax.legend(fontsize=7)
    ax = axes[0][-1]
    labels, values = [], []
    for backend in backends:
        for arm, rate in summary[backend]["prefill_tokens_per_s"].items():
            labels.append(f"{backend}\n{arm}")
            values.append(rate)
    ax.bar(range(len(values)), values, color="tab:gray")
    ax.set_xticks(range(len(values)), labels, fontsize=7)
    ax.set_ylabel("prefill tokens/s (median)")
    ax.set_title("prefill of one append")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    samples = run(args)
    summary = summarize(samples, args)
    summary["duration_s"] = round(time.perf_counter() - started, 1)
    config = {k: v for k, v in vars(args).items() if k != "smoke"}
    path = write_results(
        "bench_decode",
        config=config,
        samples=samples,
        summary=summary,
        plot=lambda png: plot({b: summary[b] for b in args.backends}, png),
        out_dir=args.out,
    )
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
