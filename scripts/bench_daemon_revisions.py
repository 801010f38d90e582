"""Decode and prefill through the daemon at two revisions of this repository, side by side in one run.

The baseline revision's packages (`inference_engine`, `kv_cache_proposer`) are exported from git (`git archive`)
into a temporary directory; the working tree is the other side. One `kakeya-runtime serve` per revision runs on a
loopback port with the daemon's default flags (plus `--model`, and any `--flags`), each importing its own tree;
`--current-env NAME=VALUE` sets a variable for the working tree's daemon alone (the same revision with and without
a setting, say). For every history length a session of that much held-out standard-library source is created on
both and its first token timed (`--prefill-repeats` fresh sessions each, every one's history starting a token later
than the one before so that none shares another's prefix, the revisions in alternating order: the prefill); each
repeat then forks the first and generates `--new-tokens` greedy tokens through the Python SDK, the
revisions in alternating order, so both meet the same load; with `--sessions N`, N forks generate at once (one thread
each) and a repeat's rate is their tokens over its wall time, the batched decoding a daemon gives concurrent
sessions. Writes `results/bench_daemon_revisions_<stamp>.json`
(config, raw samples, medians, current/baseline ratios, paired by repeat) and a PNG plot next to it.

Usage:
    python scripts/bench_daemon_revisions.py --baseline REV [--model NAME|DIR|GGUF] [--histories 1024,8192]
        [--new-tokens 64] [--sessions 1] [--repeats 7] [--prefill-repeats 1] [--flags "--threads 2"]
        [--current-env KAKEYA_DENSE_ATTENTION=compiled] [--out results]

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
from concurrent.futures import ThreadPoolExecutor
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
    p.add_argument(
        "--sessions", type=int, default=1, help="forks that generate at once per repeat (their aggregate tokens/s)"
    )
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--prefill-repeats", type=int, default=1, help="timed prefills per revision and history")
    p.add_argument("--flags", default="", help="extra `serve` flags for both daemons, one shell-quoted string")
    p.add_argument(
        "--current-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for the working tree's daemon alone (repeatable)",
    )
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    args.histories = [int(h) for h in args.histories.split(",") if h]
    if args.new_tokens < 2 or min(args.sessions, args.repeats, args.prefill_repeats) < 1 or not args.histories:
        p.error(
            "--new-tokens >= 2, --sessions >= 1, --repeats >= 1, --prefill-repeats >= 1 and at least one history "
            "are required"
        )
    if any("=" not in item or not item.partition("=")[0] for item in args.current_env):
        p.error("--current-env takes NAME=VALUE")
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


def decode(session: Any, sessions: int, new_tokens: int) -> dict[str, Any]:
    """`new_tokens` greedy tokens from `sessions` forks of `session` at once: one fork's tokens and timing alone,
    or, for several, their aggregate tokens/s over the wall time from the first request to the last token."""
    if sessions == 1:
        with session.fork() as fork:
            return timed_tokens(fork.generate(new_tokens), time.perf_counter())
    forks = [session.fork() for _ in range(sessions)]
    try:
        with ThreadPoolExecutor(sessions) as pool:
            started = time.perf_counter()
            streams = list(pool.map(lambda fork: timed_tokens(fork.generate(new_tokens), started), forks))
            wall = time.perf_counter() - started
    finally:
        for fork in forks:
            fork.close()
    tokens = streams[0]["tokens"]
    return {
        "tokens": tokens,
        "forks_agree": all(stream["tokens"] == tokens for stream in streams),
        "ttft_s": max(stream["ttft_s"] for stream in streams),
        "decode_tokens_per_s": sum(len(stream["tokens"]) for stream in streams) / wall,
    }


def summarise(samples: list[dict[str, Any]], histories: list[int]) -> dict[str, Any]:
    prefill = {
        rev: {
            str(h): round(
                statistics.median(
                    s["first_token_s"]
                    for s in samples
                    if s["kind"] == "prefill" and s["revision"] == rev and s["history"] == h
                ),
                3,
            )
            for h in histories
        }
        for rev in REVISIONS
    }
    samples = [s for s in samples if s["kind"] == "decode"]
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
    agree = all(s.get("forks_agree", True) for s in samples) and all(
        c["tokens"] == b["tokens"]
        for h in histories
        for c, b in zip(
            [s for s in samples if s["revision"] == "current" and s["history"] == h],
            [s for s in samples if s["revision"] == "baseline" and s["history"] == h],
            strict=True,
        )
    )
    prefill_ratio = {h: round(prefill["baseline"][h] / prefill["current"][h], 3) for h in prefill["current"]}
    statement = "; ".join(
        f"history {h}: decode current/baseline {ratio[h]:.2f}x (paired {paired[h]:.2f}x), "
        f"prefill {prefill_ratio[h]:.2f}x"
        for h in ratio
    )
    return {
        "first_token_s": prefill,
        "prefill_speed_current_over_baseline": prefill_ratio,
        "decode_tokens_per_s": rates,
        "current_over_baseline": ratio,
        "paired_current_over_baseline": paired,
        "tokens_agree": agree,
        "statement": statement,
    }


def plot(png: Path, summary: dict[str, Any], sessions: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates, first = summary["decode_tokens_per_s"], summary["first_token_s"]
    histories = list(rates["current"])
    fig, (decode, prefill) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.38
    for ax, values, label in ((decode, rates, "decode tokens/s (median)"), (prefill, first, "first token, s")):
        for offset, rev in ((-width / 2, "baseline"), (width / 2, "current")):
            ax.bar([i + offset for i in range(len(histories))], [values[rev][h] for h in histories], width, label=rev)
        ax.set_xticks(range(len(histories)), [f"{h} tokens" for h in histories])
        ax.set_ylabel(label)
        ax.legend()
    at_once = f", {sessions} sessions at once" if sessions > 1 else ""
    decode.set_title(f"daemon decode{at_once}: current against baseline")
    prefill.set_title("a new session's prefill to its first token")
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    flags = ["--model", str(args.model), *shlex.split(args.flags)]
    text = history_tokens(args.model, max(args.histories) + args.prefill_repeats)
    samples: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kakeya-baseline-") as tmp:
        baseline_commit = export_revision(args.baseline, Path(tmp))
        check_imports_from(Path(tmp))
        current_env = dict(item.partition("=")[::2] for item in args.current_env)
        daemons = {"baseline": Daemon(flags, env={"PYTHONPATH": tmp}), "current": Daemon(flags, env=current_env)}
        clients = {rev: kakeya.Client(daemon.wait_listening()) for rev, daemon in daemons.items()}
        try:
            for history_len in args.histories:
                held: dict[str, Any] = {}
                for repeat in range(args.prefill_repeats):
                    for rev in REVISIONS if repeat % 2 == 0 else REVISIONS[::-1]:
                        started = time.perf_counter()
                        # each repeat's history starts one token later: no session shares a prefix with another's
                        history = text[repeat : repeat + history_len]
                        session = clients[rev].create_session(initial_tokens=history, eos_token_ids=[])
                        list(session.generate(1))  # the prefill, to the first token
                        first_token_s = time.perf_counter() - started
                        samples.append(
                            {
                                "kind": "prefill",
                                "revision": rev,
                                "history": history_len,
                                "repeat": repeat,
                                "first_token_s": first_token_s,
                            }
                        )
                        print(f"{rev:>8} history {history_len:>6}: first token in {first_token_s:.2f} s", flush=True)
                        if rev in held:
                            session.close()
                        else:
                            held[rev] = session
                for repeat in range(args.repeats):
                    for rev in REVISIONS if repeat % 2 == 0 else REVISIONS[::-1]:
                        result = decode(held[rev], args.sessions, args.new_tokens)
                        samples.append(
                            {"kind": "decode", "revision": rev, "history": history_len, "repeat": repeat, **result}
                        )
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
        plot=lambda png: plot(png, summary, args.sessions),
        out_dir=args.out,
    )
    print(summary["statement"])
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
