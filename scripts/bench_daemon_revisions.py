"""Decode through the daemon at two revisions of this repository, side by side in one run.

The baseline revision's packages (`inference_engine`, `kv_cache_proposer`) are exported from git (`git archive`)
into a temporary directory; the working tree is the other side. One `kakeya-runtime serve` per revision runs on a
loopback port with the daemon's default flags (plus `--model`, and any `--flags`), each importing its own tree. For
every history length a session of that much held-out standard-library source is created and prefilled on both;
each repeat forks it and generates `--new-tokens` greedy tokens through the Python SDK, the revisions in alternating
order, so both meet the same load. Writes `results/bench_daemon_revisions_<stamp>.json` (config, raw samples,
medians, current/baseline ratios, paired by repeat) and a PNG plot next to it.

Usage:
    python scripts/bench_daemon_revisions.py --baseline REV [--model NAME|DIR|GGUF] [--histories 1024,8192]
        [--new-tokens 64] [--repeats 7] [--flags "--threads 2"] [--out results]

    --model takes a model name, a model directory or a GGUF file, as `kakeya-runtime serve --model` does (default:
    kakeya-tiny).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kakeya
from lib import revisions
from lib.daemon import Daemon
from lib.decode_arms import history_tokens, timed_tokens
from lib.model_option import add_model_option
from lib.results import RESULTS_DIR, write_results

ROOT = Path(__file__).resolve().parent.parent
REVISIONS = ("baseline", "current")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="git revision to compare the working tree with")
    add_model_option(p, "the model both daemons serve")
    p.add_argument("--histories", default="1024,8192", help="history lengths in tokens, comma-separated")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--flags", default="", help="extra `serve` flags for both daemons, one shell-quoted string")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    args.histories = [int(h) for h in args.histories.split(",") if h]
    if args.new_tokens < 2 or args.repeats < 1 or not args.histories:
        p.error("--new-tokens >= 2, --repeats >= 1 and at least one history are required")
    return args


def export_revision(revision: str, target: Path) -> str:
    """The daemon's packages at `revision`, unpacked under `target`; returns the full commit id."""
    return revisions.export_revision(
        revision, target, ("inference_engine", "kv_cache_proposer"), tool="bench_daemon_revisions"
    )


def check_imports_from(tree: Path) -> None:
    """Fail unless a process given `PYTHONPATH=tree` imports the daemon from `tree` (not the working tree)."""
    found = subprocess.run(
        [
            sys.executable,
            "-c",
            "import inference_engine, kv_cache_proposer as k; print(inference_engine.__file__, k.__file__)",
        ],
        env={**os.environ, "PYTHONPATH": str(tree)},
        cwd=tree,  # as the daemon's console script, whose first import path is its own directory
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    if not all(Path(path).resolve().is_relative_to(tree.resolve()) for path in found):
        raise SystemExit(f"bench_daemon_revisions: the baseline daemon would import {found}, not {tree}")


def summarise(samples: list[dict[str, Any]], histories: list[int]) -> dict[str, Any]:
    rates: dict[str, dict[str, float]] = {rev: {} for rev in REVISIONS}
    paired: dict[str, float] = {}
    for history in histories:
        runs = {rev: [s for s in samples if s["revision"] == rev and s["history"] == history] for rev in REVISIONS}
        for rev in REVISIONS:
            rates[rev][str(history)] = round(statistics.median(s["decode_tokens_per_s"] for s in runs[rev]), 2)
        pairs = zip(runs["current"], runs["baseline"], strict=True)
        paired[str(history)] = round(
            statistics.median(c["decode_tokens_per_s"] / b["decode_tokens_per_s"] for c, b in pairs), 3
        )
    ratio = {h: round(rates["current"][h] / rates["baseline"][h], 3) for h in rates["current"]}
    agree = all(
        c["tokens"] == b["tokens"]
        for h in histories
        for c, b in zip(
            [s for s in samples if s["revision"] == "current" and s["history"] == h],
            [s for s in samples if s["revision"] == "baseline" and s["history"] == h],
            strict=True,
        )
    )
    statement = "; ".join(f"history {h}: current/baseline {ratio[h]:.2f}x (paired {paired[h]:.2f}x)" for h in ratio)
    return {
        "decode_tokens_per_s": rates,
        "current_over_baseline": ratio,
        "paired_current_over_baseline": paired,
        "tokens_agree": agree,
        "statement": statement,
    }


def plot(png: Path, summary: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = summary["decode_tokens_per_s"]
    histories = list(rates["current"])
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.38
    for offset, rev in ((-width / 2, "baseline"), (width / 2, "current")):
        ax.bar([i + offset for i in range(len(histories))], [rates[rev][h] for h in histories], width, label=rev)
    ax.set_xticks(range(len(histories)), [f"{h} tokens" for h in histories])
    ax.set_ylabel("decode tokens/s (median)")
    ax.set_title("daemon decode: current against baseline")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    flags = ["--model", str(args.model), *shlex.split(args.flags)]
    text = history_tokens(args.model, max(args.histories))
    samples: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kakeya-baseline-") as tmp:
        baseline_commit = export_revision(args.baseline, Path(tmp))
        check_imports_from(Path(tmp))
        daemons = {"baseline": Daemon(flags, env={"PYTHONPATH": tmp}), "current": Daemon(flags)}
        clients = {rev: kakeya.Client(daemon.wait_listening()) for rev, daemon in daemons.items()}
        try:
            for history_len in args.histories:
                held = {
                    rev: client.create_session(initial_tokens=text[:history_len], eos_token_ids=[])
                    for rev, client in clients.items()
                }
                for session in held.values():
                    list(session.generate(1))  # the prefill
                for repeat in range(args.repeats):
                    for rev in REVISIONS if repeat % 2 == 0 else REVISIONS[::-1]:
                        with held[rev].fork() as fork:
                            result = timed_tokens(fork.generate(args.new_tokens), time.perf_counter())
                        samples.append({"revision": rev, "history": history_len, "repeat": repeat, **result})
                        print(
                            f"{rev:>8} history {history_len:>6}: {result['decode_tokens_per_s']:.1f} tok/s", flush=True
                        )
                for session in held.values():
                    session.close()
        finally:
            for client in clients.values():
                client.close()
            for daemon in daemons.values():
                daemon.stop()
    summary = summarise(samples, args.histories)
    config = {**vars(args), "model": str(args.model), "out": str(args.out), "baseline_commit": baseline_commit}
    path = write_results(
        "bench_daemon_revisions",
        config=config,
        samples=samples,
        summary=summary,
        plot=lambda png: plot(png, summary),
        out_dir=args.out,
    )
    print(summary["statement"])
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
