"""Benchmark the MLX backend's decode path against mlx-lm's own generation loop on the same model and history.

Both sides load the same model directory and decode the same history greedily, alternating run by run:
- `kakeya`: the MLX verifier driven by the engine's decode step (`Decoder.step` on a `full` session cache), the
  loop a daemon generation runs, without the gRPC transport;
- `mlx_lm`: `mlx_lm.generate.generate_step` run directly: the generation loop that `mlx_lm.generate` and
  `mlx_lm.stream_generate` drive, with mlx-lm's own KV cache, prefill and asynchronous evaluation.
Both prefill in chunks of `--prefill-chunk` tokens. For each run it records the time to the first token (the
prefill of the history plus the first decode step) and the decode rate after it (tokens/s over the remaining
tokens), checks that both produced the same tokens, and writes `results/bench_mlx_backend_<stamp>.json` (config,
environment, raw samples, summary with the kakeya / mlx_lm ratios) and a PNG plot next to it.

Usage:
    python scripts/bench_mlx_backend.py [--model NAME|DIR|GGUF] [--history-tokens 1024] [--new-tokens 128]
        [--repeats 15] [--prefill-chunk 512] [--device auto|cpu|gpu] [--dtype auto|float32|bfloat16|float16]
        [--out results]
    python scripts/bench_mlx_backend.py --smoke    # seconds-long run with tiny sizes (tests)

    --model takes a model name, a model directory or a GGUF file, as `kakeya-runtime serve --model` does (default:
    kakeya-tiny); any directory mlx-lm loads works (convert other Hugging Face checkpoints with
    scripts/convert_hf_to_mlx.py first).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlx.core as mx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.model_option import add_model_option
from lib.results import write_results

from kv_cache_proposer.backends.mlx_backend.loader import load_mlx_model, resolve_device, resolve_dtype
from kv_cache_proposer.backends.mlx_backend.verifier import MlxVerifier
from kv_cache_proposer.decoding import Decoder, GenerationBudget, SequenceState
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import FullStrategy

ROOT = Path(__file__).resolve().parent.parent

SYSTEMS = ("kakeya", "mlx_lm")


def history_tokens(vocab_size: int, length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(length)]


def run_kakeya(verifier: MlxVerifier, history: list[int], new_tokens: int, chunk: int) -> dict[str, Any]:
    """One generation through the engine's decode step; times are wall-clock from the first forward."""
    decoder = Decoder(verifier, prefill_chunk_tokens=chunk)
    seq = SequenceState(cache=verifier.new_cache(FullStrategy()), tokens=list(history))
    budget, params = GenerationBudget(max_new_tokens=new_tokens), SamplingParams()
    tokens: list[int] = []
    stamps: list[float] = []
    start = time.perf_counter()
    while len(tokens) < new_tokens:
        step = decoder.step(seq, params, budget, len(tokens))
        now = time.perf_counter()
        tokens += step.tokens
        stamps += [now] * len(step.tokens)
    seq.cache.release()
    return _sample(tokens, start, stamps)


def run_mlx_lm(model: Any, history: list[int], new_tokens: int, chunk: int) -> dict[str, Any]:
    """One generation through mlx-lm's own loop with its own cache."""
    from mlx_lm.generate import generate_step

    tokens: list[int] = []
    stamps: list[float] = []
    start = time.perf_counter()
    prompt = mx.array(history)
    for token, _ in generate_step(prompt, model, max_tokens=new_tokens, prefill_step_size=chunk):
        tokens.append(int(token))
        stamps.append(time.perf_counter())
    return _sample(tokens, start, stamps)


def _sample(tokens: list[int], start: float, stamps: list[float]) -> dict[str, Any]:
    decode_s = stamps[-1] - stamps[0]
    return {
        "tokens": tokens,
        "time_to_first_token_s": stamps[0] - start,
        "decode_s": decode_s,
        "decode_tokens_per_s": (len(tokens) - 1) / decode_s if decode_s > 0 else None,
    }


def summarize(samples: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    def median(system: str, key: str) -> float:
        return statistics.median(s[key] for s in samples[system])

    kakeya_tps, raw_tps = median("kakeya", "decode_tokens_per_s"), median("mlx_lm", "decode_tokens_per_s")
    kakeya_ttft, raw_ttft = median("kakeya", "time_to_first_token_s"), median("mlx_lm", "time_to_first_token_s")
    reference = samples["mlx_lm"][0]["tokens"]
    return {
        "kakeya_decode_tokens_per_s": kakeya_tps,
        "mlx_lm_decode_tokens_per_s": raw_tps,
        "decode_tokens_per_s_ratio": kakeya_tps / raw_tps,
        "kakeya_time_to_first_token_s": kakeya_ttft,
        "mlx_lm_time_to_first_token_s": raw_ttft,
        "time_to_first_token_ratio": kakeya_ttft / raw_ttft,
        "tokens_identical": all(s["tokens"] == reference for system in SYSTEMS for s in samples[system]),
        "statement": (
            f"kakeya's MLX decode path runs at {kakeya_tps / raw_tps:.2f}x the decode tokens/s of mlx-lm's own "
            f"loop and takes {kakeya_ttft / raw_ttft:.2f}x its time to first token (medians)"
        ),
    }


def plot(samples: dict[str, Any], summary: dict[str, Any], config: dict[str, Any], device: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    panels = (
        ("time_to_first_token_s", "time to first token (s)", "prefill of the history + first step"),
        ("decode_tokens_per_s", "decode tokens/s", "after the first token"),
    )
    for ax, (key, label, note) in zip(axes, panels, strict=True):
        for x, system in enumerate(SYSTEMS):
            values = [s[key] for s in samples[system]]
            ax.bar(x, statistics.median(values), color=("tab:blue", "tab:gray")[x], alpha=0.8)
            ax.scatter([x] * len(values), values, color="black", s=12, zorder=3)
        ax.set_xticks(range(len(SYSTEMS)), ["kakeya MLX backend", "mlx_lm generate_step"])
        ax.set_ylabel(label)
        ax.set_title(note, fontsize=9)
    fig.suptitle(
        f"{config['model_name']}: {config['history_tokens']}-token history, {config['new_tokens']} new tokens, "
        f"{device}\ndecode ratio {summary['decode_tokens_per_s_ratio']:.2f}x, "
        f"time-to-first-token ratio {summary['time_to_first_token_ratio']:.2f}x (kakeya / mlx_lm, medians)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(parser)
    parser.add_argument("--history-tokens", type=int, default=1024, help="history length prefilled before decoding")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per run")
    parser.add_argument("--repeats", type=int, default=15, help="timed runs per system (after one warm-up each)")
    parser.add_argument("--prefill-chunk", type=int, default=512, help="prefill chunk tokens, for both systems")
    parser.add_argument("--device", default="auto", help="auto, cpu or gpu")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    parser.add_argument("--out", type=Path, default=ROOT / "results", help="output directory")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes for a seconds-long check")
    args = parser.parse_args(argv)
    if args.smoke:
        args.history_tokens, args.new_tokens, args.repeats, args.prefill_chunk = 40, 6, 1, 16
    if args.history_tokens < 2 or args.new_tokens < 2 or args.repeats < 1 or args.prefill_chunk < 1:
        parser.error("--history-tokens and --new-tokens must be >= 2, --repeats and --prefill-chunk >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    verifier = MlxVerifier.load(args.model, device=args.device, dtype=args.dtype)
    raw_model = load_mlx_model(args.model, dtype).model  # a separate copy: mlx-lm's loop owns its model
    history = history_tokens(verifier.vocab_size, args.history_tokens)
    runners = {
        "kakeya": lambda: run_kakeya(verifier, history, args.new_tokens, args.prefill_chunk),
        "mlx_lm": lambda: run_mlx_lm(raw_model, history, args.new_tokens, args.prefill_chunk),
    }
    samples: dict[str, list[dict[str, Any]]] = {system: [] for system in SYSTEMS}
    with mx.stream(device):
        for system in SYSTEMS:
            runners[system]()  # warm-up: kernels, allocator
        for _ in tqdm(range(args.repeats), desc="bench_mlx_backend", unit="round", file=sys.stderr):
            for system in SYSTEMS:
                samples[system].append(runners[system]())

    summary = summarize(samples)
    config = {
        "model": str(args.model),
        "model_name": args.model_name,
        "history_tokens": args.history_tokens,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "prefill_chunk_tokens": args.prefill_chunk,
        "sampling": "greedy",
        "kv_strategy": "full",
        "device": args.device,
        "dtype": args.dtype,
    }
    json_path = write_results(
        "bench_mlx_backend",
        config=config,
        samples=samples,
        summary=summary,
        plot=lambda png: plot(samples, summary, config, verifier.description, png),
        out_dir=args.out,
        environment_extra={"mlx": version("mlx"), "mlx_lm": version("mlx-lm"), "device": verifier.description},
    )
    print(summary["statement"])
    print(f"wrote {json_path} and {json_path.with_suffix('.png').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
