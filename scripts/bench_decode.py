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

On torch every arm, decode and prefill, runs once per `--weights` choice (how the linear layers are held: float32,
bfloat16, int8, int4; activations and K/V stay float32): the daemon started with `--weights W`, the engine and the
bare loops over one `TorchVerifier` loaded with `weights=W` (the bare loops call its transformers modules, whose
linear layers are the same packed ones). float32 arms keep the plain names; the others carry `@W`
(`daemon:none@int4`, `bare_loop@int4`). MLX takes no choice: its arms run float32. With `--compile`, every torch
daemon and the engine also run with their decode steps compiled by torch.compile (`--compile on`), as arms named
`<arm>+compiled` (`daemon:none+compiled`, `engine+compiled@int4`) beside their scripted selves; `--device` puts
the torch arms on another device (a GPU: `cuda`).

Decode rate is (tokens - 1) / (time of the last token - time of the first). Arms, of every weights choice, alternate
within each repeat, so machine noise hits them alike; the summary holds, per backend, medians
(`decode_tokens_per_s`), every arm's ratio to the bare loop of its backend and weights (`bare_loop[@W]` on torch,
`mlx_lm` on MLX: `decode_ratio_to_bare`), and per arm the per-token decode time at the longest history over the
shortest. The prefill part (`--prefill-repeats` times) appends `--prefill-tokens` to a fresh session and times it
to the first token: the daemon (its own prefill seconds), the engine with its default chunk (`engine`) and with each
of `--prefill-chunks` (`engine:N`), the daemons of `--mlx-daemon-blas`, and one bare forward (on MLX, of the model
as mlx-lm loads it), each over the one bare forward of its weights (`prefill_ratio_to_one_forward`). Greedy tokens of
daemon:none (and its BLAS variants), engine and the bare loop of one weights choice must agree (float32
activations: `tokens_agree`). `weights` holds per choice the daemon without a proposer: its decode and prefill
tokens/s, their ratios to the float32 daemon's (`daemon:none@W / daemon:none`, when float32 is among the choices),
whether its weights' arms agree, and, for information only, how many decoded tokens it shares with the float32
daemon before the first that differs. `compiled` holds per compiled arm its compile seconds (at its start, from the
inductor cache where that holds the graphs), its decode rate over its scripted self's per history, and whether its
greedy tokens equal its scripted self's (compiled kernels round differently, so they may part at a near tie).

Writes `results/bench_decode_<stamp>.json` and a PNG plot next to it.

Usage:
    python scripts/bench_decode.py [--backends torch,mlx] [--histories 1024,8192,32768] [--mlx-histories 1024,8192]
        [--mlx-engine-bursts 1] [--mlx-blas bundled] [--mlx-daemon-blas auto] [--new-tokens 128]
        [--prefill-tokens 8192] [--repeats 10] [--prefill-repeats 3] [--prefill-chunks 2048,8192]
        [--weights float32,bfloat16,int8,int4] [--compile] [--device cpu] [--threads 0]
        [--daemon-proposers none,dflash] [--model NAME|DIR|GGUF] [--out results]
    python scripts/bench_decode.py --smoke    # seconds-long run with tiny sizes (tests)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.decode_arms import (
    Arm,
    DaemonArm,
    Prefill,
    compiled_engine,
    engine_prefill,
    history_tokens,
    mlx_arms,
    torch_arms,
)
from lib.decode_summary import BARE, named, summarize, unnamed
from lib.model_option import add_model_option
from lib.results import RESULTS_DIR, write_results

from inference_engine.model_dir_info import model_drafter
from kv_cache_proposer.backends import WEIGHTS
from kv_cache_proposer.backends.mlx_blas import use_mlx_blas

# The hatch of each weights choice's bars in the plot (the colour is the arm's).
HATCHES = {"float32": "", "bfloat16": "//", "int8": "xx", "int4": ".."}


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
    p.add_argument(
        "--weights",
        default="float32",
        help="torch: every arm once per choice of how the linear layers are held, comma-separated: "
        f"{', '.join(WEIGHTS)} (default: float32; MLX arms run float32)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch: the engine and every daemon also run with their decode steps compiled (`<arm>+compiled`)",
    )
    p.add_argument("--device", default="cpu", help="device of the torch arms: cpu, cuda, cuda:N (default: cpu)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads of every arm; 0: one per usable core")
    p.add_argument(
        "--daemon-proposers",
        default="none,dflash",
        help="one daemon arm per proposer (must hold none); PROPOSER/POLICY runs it under that --draft-policy",
    )
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
    args.weights = list(dict.fromkeys(w for w in args.weights.split(",") if w))
    if args.threads == 0:
        args.threads = len(os.sched_getaffinity(0))
    unknown = set(args.backends) - set(BARE)
    if unknown:
        p.error(f"unknown backends {sorted(unknown)}")
    if not args.weights or set(args.weights) - set(WEIGHTS):
        p.error(f"--weights takes a comma-separated list of {', '.join(WEIGHTS)}, not {','.join(args.weights)!r}")
    if "mlx" in args.backends and args.weights != ["float32"]:
        print("note: MLX takes no --weights: the MLX arms run float32", file=sys.stderr)
    drafters = [d for d in args.daemon_proposers if d.partition("/")[0] == "dflash"]
    if drafters and model_drafter(args.model) is None:
        print(f"note: {args.model_name} ships no DFlash drafter (dflash/): no daemon:dflash arm", file=sys.stderr)
        args.daemon_proposers = [d for d in args.daemon_proposers if d not in drafters]
    if "none" not in args.daemon_proposers:
        p.error("--daemon-proposers must hold none (the prefill arm and the token check use it)")
    if any(burst < 1 for burst in args.mlx_engine_bursts):
        p.error("--mlx-engine-bursts must hold lengths >= 1")
    if args.new_tokens < 2 or args.repeats < 1 or args.prefill_repeats < 1 or args.prefill_tokens < 1:
        p.error("--new-tokens >= 2, --repeats >= 1, --prefill-repeats >= 1 and --prefill-tokens >= 1 are required")
    return args


# -- the run -------------------------------------------------------------------------------------------------------
def lineup(
    backend: str, weights: str, args: argparse.Namespace, daemons: list[DaemonArm], compile_s: dict[str, float]
) -> tuple[dict[str, Arm], dict[str, Prefill]]:
    """The decode and the prefill arms of one backend at one weights choice, by their names (`named`); the daemons
    started join `daemons`, which the caller stops, and the compiled arms' compile seconds join `compile_s`."""
    arms, bare_prefill, verifier = torch_arms(args, weights) if backend == "torch" else mlx_arms(args)
    compiled = args.compile and backend == "torch"
    if compiled:
        arms["engine+compiled"], compile_s[named("engine+compiled", weights)] = compiled_engine(verifier)
    started: dict[str, DaemonArm] = {}
    for proposer in args.daemon_proposers:
        for compiled_steps in (False, True) if compiled else (False,):
            daemon = DaemonArm(backend, proposer, args, weights=weights, compiled=compiled_steps)
            daemons.append(daemon)
            name = f"daemon:{proposer}" + ("+compiled" if compiled_steps else "")
            started[name] = daemon
            if daemon.compile_s is not None:
                compile_s[named(name, weights)] = daemon.compile_s
    for choice in args.mlx_daemon_blas if backend == "mlx" else []:
        daemon = DaemonArm(backend, "none", args, blas=choice)
        daemons.append(daemon)
        started[f"daemon:none:blas={choice}"] = daemon
    decode: dict[str, Arm] = {**started, **arms}
    prefill: dict[str, Prefill] = {name: d.prefill for name, d in started.items() if name.startswith("daemon:none")}
    prefill["engine"] = engine_prefill(verifier)
    prefill |= {f"engine:{chunk}": engine_prefill(verifier, chunk) for chunk in args.prefill_chunks}
    prefill["one_forward"] = bare_prefill
    return (
        {named(name, weights): arm for name, arm in decode.items()},
        {named(name, weights): arm for name, arm in prefill.items()},
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    samples: dict[str, Any] = {"decode": [], "prefill": [], "compile": []}
    longest = max([*args.histories, *args.mlx_histories, args.prefill_tokens])
    text = history_tokens(args.model, longest)
    for backend in args.backends:
        daemons: list[DaemonArm] = []
        try:
            # name -> (weights, arm); every weights choice's arms in one lineup, so they alternate within a repeat
            every: dict[str, tuple[str, Arm]] = {}
            prefills: dict[str, tuple[str, Prefill]] = {}
            for weights in args.weights if backend == "torch" else ["float32"]:
                compile_s: dict[str, float] = {}
                arms, prefill_arms = lineup(backend, weights, args, daemons, compile_s)
                every |= {name: (weights, arm) for name, arm in arms.items()}
                prefills |= {name: (weights, prefill) for name, prefill in prefill_arms.items()}
                for name, seconds in compile_s.items():
                    samples["compile"].append(
                        {"backend": backend, "arm": name, "weights": weights, "compile_s": seconds}
                    )
                    print(f"{backend} {name:>22} compiled in {seconds:.1f} s", flush=True)
            histories = args.histories if backend == "torch" else args.mlx_histories
            for history_len in histories:
                history = text[:history_len]
                decodings = {name: (weights, arm(history)) for name, (weights, arm) in every.items()}
                for repeat in range(args.repeats):
                    order = list(decodings) if repeat % 2 == 0 else list(reversed(decodings))
                    for name in order:
                        weights, decoding = decodings[name]
                        result = decoding(args.new_tokens)
                        samples["decode"].append(
                            {"backend": backend, "arm": name, "weights": weights, "history": history_len, **result}
                        )
                        print(
                            f"{backend} {name:>22} history {history_len:>6}: "
                            f"{result['decode_tokens_per_s']:7.1f} tok/s",
                            flush=True,
                        )
                del decodings
            appended = text[: args.prefill_tokens]
            for _ in range(args.prefill_repeats):
                for name, (weights, prefill) in prefills.items():
                    result = prefill(appended)
                    samples["prefill"].append(
                        {"backend": backend, "arm": name, "weights": weights, "tokens": len(appended), **result}
                    )
                    print(f"{backend} prefill {name:>17}: {result['prefill_s']:.3f} s", flush=True)
        finally:
            for daemon in daemons:
                daemon.close()
    return samples


# -- the plot ------------------------------------------------------------------------------------------------------
def plot(summary: dict[str, Any], path: Path) -> None:
    """One decode panel per backend (bars: the arm's colour, the weights choice's hatch) and one prefill panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    backends = list(summary)
    fig, axes = plt.subplots(1, len(backends) + 1, figsize=(6.5 * (len(backends) + 1), 4.8), squeeze=False)
    colours = [f"C{i}" for i in range(10)]  # the default colour cycle
    for ax, backend in zip(axes[0], backends, strict=False):
        rates = summary[backend]["decode_tokens_per_s"]
        names = list(rates)
        plain = list(dict.fromkeys(unnamed(name)[0] for name in names))
        choices = list(dict.fromkeys(unnamed(name)[1] for name in names))
        histories = list(next(iter(rates.values())))
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            arm, weights = unnamed(name)
            xs = np.arange(len(histories)) + i * width
            colour = colours[plain.index(arm) % len(colours)]
            ax.bar(xs, [rates[name][h] for h in histories], width, color=colour, hatch=HATCHES[weights])
        ax.set_xticks(np.arange(len(histories)) + 0.4 - width / 2, [f"{int(h):,}" for h in histories])
        ax.set_xlabel("history tokens")
        ax.set_ylabel("decode tokens/s (median)")
        ax.set_title(f"{backend}: decode")
        handles = [Patch(color=colours[i % len(colours)], label=arm) for i, arm in enumerate(plain)]
        if len(choices) > 1:  # a second block of the legend: the hatch of each weights choice
            handles += [Patch(facecolor="white", edgecolor="black", hatch=HATCHES[w], label=w) for w in choices]
        # below the panel, beside each other: many arms would cover the bars
        ax.legend(handles=handles, fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
    ax = axes[0][-1]
    bars = [
        (backend, name, rate) for backend in backends for name, rate in summary[backend]["prefill_tokens_per_s"].items()
    ]
    ax.bar(
        range(len(bars)),
        [rate for *_, rate in bars],
        color="tab:gray",
        hatch=[HATCHES[unnamed(n)[1]] for _, n, _ in bars],
    )
    if len(bars) > 6:  # many bars: slanted one-line labels, so they do not overlap
        ax.set_xticks(range(len(bars)), [f"{b} {n}" for b, n, _ in bars], fontsize=7, rotation=60, ha="right")
    else:
        ax.set_xticks(range(len(bars)), [f"{b}\n{n}" for b, n, _ in bars], fontsize=7)
    ax.set_ylabel("prefill tokens/s (median)")
    ax.set_title("prefill of one append")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
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
