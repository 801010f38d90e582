"""Decode and prefill speed of the daemon against the bare library loops, side by side in one run.

For every history length the same text (held-out standard-library source tokenized with the model's tokenizer) is
prefilled once per arm, untimed, with its first greedy token; each repeat then decodes `--new-tokens` more greedy
tokens from a copy of that state (a fork of the daemon's session, a clone of the engine's cache, a copy of
transformers' cache, mlx-lm's cache trimmed back), so repeats cost no prefill and can be many. The arms:

- both backends: `daemon:<proposer>` (`kakeya-runtime serve` through the Python SDK, one daemon per
  `--daemon-proposers` entry; `none` is plain decoding, `dflash` the model's own `dflash/` drafter, skipped with a
  note when the model ships none) and `engine` (`Decoder.step` in-process, no proposer, no gRPC);
- torch: `bare_loop` (the model called token by token with transformers' `DynamicCache`) and `generate`
  (`model.generate` with a streamer timing each token);
- mlx: `mlx_lm` (mlx-lm's own `generate_step` over the model as mlx-lm loads it), `mlx_lm:input_major` (the same
  loop over the engine's input-major weights, which the MLX verifier keeps on a CPU) and `engine:burstN` for each
  of `--mlx-engine-bursts` (the engine with bursts of N decode steps per call instead of its default,
  `--decode-burst-tokens`; 1 is one step per call), and `daemon:none:blas=<choice>` for each of
  `--mlx-daemon-blas` (a daemon whose MLX kernels call that CBLAS library, `--mlx-blas` of the daemon).

Every other MLX arm, in this process and in the daemons, runs on the CBLAS library of `--mlx-blas` (default
`bundled`, the reference BLAS of the Linux `mlx[cpu]` wheel).

Decode rate is (tokens - 1) / (time of the last token - time of the first). Arms alternate within each repeat, so
machine noise hits them alike; the summary holds medians and every arm's ratio to the bare loop of its backend
(`bare_loop` on torch, `mlx_lm` on MLX), and per arm the per-token decode time at the longest history over the
shortest. The prefill part (`--prefill-repeats` times) appends `--prefill-tokens` to a fresh session and times it
to the first token: the daemon (its own prefill seconds), the engine with its default chunk (`engine`) and with each
of `--prefill-chunks` (`engine:N`), the daemons of `--mlx-daemon-blas`, and one bare forward (on MLX, of the model
as mlx-lm loads it). Greedy tokens of daemon:none (and its BLAS variants), engine and the bare loop must agree
(float32).

Writes `results/bench_decode_<stamp>.json` and a PNG plot next to it.

Usage:
    python scripts/bench_decode.py [--backends torch,mlx] [--histories 1024,8192,32768] [--mlx-histories 1024,8192]
        [--mlx-engine-bursts 1] [--mlx-blas bundled] [--mlx-daemon-blas auto] [--new-tokens 128]
        [--prefill-tokens 8192] [--repeats 10] [--prefill-repeats 3]
        [--threads 0] [--daemon-proposers none,dflash] [--model NAME|DIR|GGUF] [--out results]
    python scripts/bench_decode.py --smoke    # seconds-long run with tiny sizes (tests)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.decode_arms import Arm, DaemonArm, Prefill, engine_prefill, history_tokens, mlx_arms, torch_arms
from lib.model_option import add_model_option
from lib.results import RESULTS_DIR, write_results

from inference_engine.config import model_drafter
from kv_cache_proposer.backends.mlx_blas import use_mlx_blas

BARE = {"torch": "bare_loop", "mlx": "mlx_lm"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="torch,mlx", help="comma-separated: torch, mlx (default: both)")
    p.add_argument("--histories", default="1024,8192,32768", help="torch history lengths in tokens")
    p.add_argument("--mlx-histories", default="1024,8192", help="MLX history lengths (its CPU prefill is slow)")
    p.add_argument(
        "--mlx-blas", default="bundled", help="CBLAS library of every MLX arm: bundled, auto or a path (--mlx-blas)"
    )
    p.add_argument(
        "--mlx-daemon-blas", default="", help="more MLX daemon arms (no proposer), one per CBLAS library choice"
    )
    p.add_argument("--new-tokens", type=int, default=128, help="greedy tokens decoded per run (default: 128)")
    p.add_argument(
        "--mlx-engine-bursts", default="1", help="more MLX engine arms, one per decode burst length (default: 1)"
    )
    p.add_argument("--prefill-tokens", type=int, default=8192, help="tokens of the timed append (default: 8192)")
    p.add_argument("--repeats", type=int, default=10, help="decodings of every arm per history (default: 10)")
    p.add_argument("--prefill-repeats", type=int, default=3, help="timed prefills of every prefill arm (default: 3)")
    p.add_argument(
        "--prefill-chunks",
        default="2048,8192",
        help="more engine prefill arms, one per chunk size, beside the default chunk (default: 2048,8192)",
    )
    p.add_argument("--threads", type=int, default=0, help="CPU threads of every arm; 0: one per usable core")
    p.add_argument("--daemon-proposers", default="none,dflash", help="one daemon arm per proposer (must hold none)")
    add_model_option(p, "the model both backends load and the daemons serve")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder (default: results/)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, for tests")
    args = p.parse_args(argv)
    if args.smoke:
        args.histories = args.mlx_histories = "48,96"
        args.new_tokens, args.prefill_tokens, args.repeats, args.daemon_proposers = 6, 64, 2, "none"
        args.prefill_repeats = 1
        args.prefill_chunks = "16"
    args.backends = [b for b in args.backends.split(",") if b]
    args.histories = [int(h) for h in args.histories.split(",") if h]
    args.mlx_histories = [int(h) for h in args.mlx_histories.split(",") if h]
    args.daemon_proposers = [d for d in args.daemon_proposers.split(",") if d]
    args.prefill_chunks = [int(c) for c in args.prefill_chunks.split(",") if c]
    args.mlx_daemon_blas = [c for c in args.mlx_daemon_blas.split(",") if c]
    args.mlx_engine_bursts = [int(b) for b in args.mlx_engine_bursts.split(",") if b]
    if args.threads == 0:
        args.threads = len(os.sched_getaffinity(0))
    unknown = set(args.backends) - set(BARE)
    if unknown:
        p.error(f"unknown backends {sorted(unknown)}")
    if "dflash" in args.daemon_proposers and model_drafter(args.model) is None:
        print(f"note: {args.model_name} ships no DFlash drafter (dflash/): no daemon:dflash arm", file=sys.stderr)
        args.daemon_proposers.remove("dflash")
    if "none" not in args.daemon_proposers:
        p.error("--daemon-proposers must hold none (the prefill arm and the token check use it)")
    if any(burst < 1 for burst in args.mlx_engine_bursts):
        p.error("--mlx-engine-bursts must hold lengths >= 1")
    if args.new_tokens < 2 or args.repeats < 1 or args.prefill_repeats < 1 or args.prefill_tokens < 1:
        p.error("--new-tokens >= 2, --repeats >= 1, --prefill-repeats >= 1 and --prefill-tokens >= 1 are required")
    return args


# -- the run -------------------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    samples: dict[str, Any] = {"decode": [], "prefill": []}
    longest = max([*args.histories, *args.mlx_histories, args.prefill_tokens])
    text = history_tokens(args.model, longest)
    for backend in args.backends:
        arms, bare_prefill, verifier = torch_arms(args) if backend == "torch" else mlx_arms(args)
        daemons = {f"daemon:{p}": DaemonArm(backend, p, args) for p in args.daemon_proposers}
        if backend == "mlx":
            daemons |= {f"daemon:none:blas={c}": DaemonArm(backend, "none", args, blas=c) for c in args.mlx_daemon_blas}
        try:
            every: dict[str, Arm] = {**daemons, **arms}
            histories = args.histories if backend == "torch" else args.mlx_histories
            for history_len in histories:
                history = text[:history_len]
                decodings = {name: arm(history) for name, arm in every.items()}
                for repeat in range(args.repeats):
                    order = list(decodings) if repeat % 2 == 0 else list(reversed(decodings))
                    for name in order:
                        result = decodings[name](args.new_tokens)
                        samples["decode"].append({"backend": backend, "arm": name, "history": history_len, **result})
                        print(
                            f"{backend} {name:>18} history {history_len:>6}: "
                            f"{result['decode_tokens_per_s']:7.1f} tok/s",
                            flush=True,
                        )
                del decodings
            appended = text[: args.prefill_tokens]
            prefills: dict[str, Prefill] = {
                name: daemon.prefill for name, daemon in daemons.items() if name.startswith("daemon:none")
            }
            prefills["engine"] = engine_prefill(verifier)
            prefills |= {f"engine:{chunk}": engine_prefill(verifier, chunk) for chunk in args.prefill_chunks}
            prefills["one_forward"] = bare_prefill
            for _ in range(args.prefill_repeats):
                for name, prefill in prefills.items():
                    result = prefill(appended)
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
        part["repeats_agree"] = repeats_agree(decode)
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
    """Whether the greedy tokens of the daemons without a proposer (on every BLAS), the engine and the bare loop
    agree."""
    compared = {"engine", BARE[backend]}
    by_history: dict[int, set[tuple[int, ...]]] = {}
    for sample in decode:
        if sample["arm"] in compared or sample["arm"].startswith("daemon:none"):
            by_history.setdefault(sample["history"], set()).add(tuple(sample["tokens"]))
    return all(len(outputs) == 1 for outputs in by_history.values())


def repeats_agree(decode: list[dict[str, Any]]) -> bool:
    """Whether every arm decoded the same tokens at every repeat of a history (each starts from the same state)."""
    by_arm: dict[tuple[str, int], set[tuple[int, ...]]] = {}
    for sample in decode:
        by_arm.setdefault((sample["arm"], sample["history"]), set()).add(tuple(sample["tokens"]))
    return all(len(outputs) == 1 for outputs in by_arm.values())


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
    if "mlx" in args.backends:
        args.mlx_blas_in_process = str(use_mlx_blas(args.mlx_blas))
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
