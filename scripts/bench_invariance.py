"""INV-3 through the daemon: a session's greedy tokens against the same history delivered in other shapes.

For each of `--histories` held-out standard-library histories of `--history-tokens` tokens (each from its own
place in the held-out text), a reference session is created with the whole history at once and generates
`--new-tokens` greedy tokens alone (no EOS stops it). The same history then reaches the daemon in every other
shape, and each generates `--new-tokens` tokens from it:

- `turns of N` (N in `--turn-tokens`): appended N tokens at a time, each turn followed by a generation of
  `--turn-new-tokens` tokens; the history then includes those, so its reference is a fresh session created with
  that whole history (one block), which generates alongside.
- `token by token`: the first tokens in one block, then the last `--token-tail` tokens appended one at a time,
  each followed by one generated token (a forward of one new token and one decode step each); referenced as turns.
- `fork`: a fork, at the history's length, of the reference once it generated (its cache a copy of the K/V the
  reference computed; the fork's first step computes only the last history token).
- `journal`: a session created with the history on a daemon with `--state-dir`, which is then stopped and started
  again; the session comes back from the journal and its K/V is rebuilt by the next generation's prefill.
- `among K` (K in `--batch-others`): the reference history generating at once with K other sessions of other
  lengths (batched forwards), against the reference generated alone.

Every comparison is token for token; a shape matches when all `--new-tokens` tokens are equal. With `--logprobs`
every compared generation also returns each token's log-probability, and a shape matches only when those floats
are equal too: a check of the values, which a near-tie need not expose. The daemon runs its
default flags plus `--flags`. Writes `results/bench_invariance_<stamp>.json` (per history and shape: match, first
differing index) and a PNG of mismatches per shape.

Usage:
    python scripts/bench_invariance.py [--model NAME|DIR|GGUF] [--histories 50] [--history-tokens 1100]
        [--new-tokens 32] [--turn-tokens 512 300 64] [--turn-new-tokens 2] [--token-tail 24]
        [--batch-others 1 3 7] [--logprobs] [--flags "..."] [--results-dir DIR]
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kakeya
from lib.daemon import Daemon
from lib.decode_arms import history_tokens
from lib.model_option import add_model_option
from lib.results import RESULTS_DIR, write_results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(p, "the model the daemon serves")
    p.add_argument("--histories", type=int, default=50, help="held-out histories (default: 50)")
    p.add_argument("--history-tokens", type=int, default=1100, help="tokens of each history (default: 1100)")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens compared per shape (default: 32)")
    p.add_argument(
        "--turn-tokens", type=int, nargs="*", default=[512, 300, 64], help="turn sizes (default: 512 300 64)"
    )
    p.add_argument("--turn-new-tokens", type=int, default=2, help="tokens generated after each turn (default: 2)")
    p.add_argument(
        "--token-tail", type=int, default=24, help="history tokens appended one at a time (default: 24; 0: none)"
    )
    p.add_argument(
        "--batch-others", type=int, nargs="*", default=[1, 3, 7], help="sessions generating beside (default: 1 3 7)"
    )
    p.add_argument("--logprobs", action="store_true", help="compare each token's log-probability too (bit for bit)")
    p.add_argument("--flags", default="", help="more daemon flags, as one string")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the JSON and PNG go")
    args = p.parse_args(argv)
    if args.histories < 1 or args.history_tokens < 2 or args.new_tokens < 1 or args.turn_new_tokens < 0:
        p.error("--histories >= 1, --history-tokens >= 2, --new-tokens >= 1 and --turn-new-tokens >= 0 are required")
    if any(n < 1 for n in args.turn_tokens) or not 0 <= args.token_tail < args.history_tokens:
        p.error("turn sizes must be >= 1 and --token-tail below --history-tokens")
    if any(k < 1 for k in args.batch_others) or max(args.batch_others, default=0) >= args.histories:
        p.error("--batch-others must be >= 1 and below --histories (the others are the other histories)")
    return args


def greedy(session: kakeya.Session, count: int) -> list[int]:
    return [int(token) for token in session.generate(count)]


def compared(session: kakeya.Session, count: int, logprobs: bool) -> list[Any]:
    """A generation to compare: its tokens, with `logprobs` (`--logprobs`) each paired with its log-probability."""
    if not logprobs:
        return greedy(session, count)
    stream = session.generate(count, controls=kakeya.GenerationControls(logprobs=True))
    tokens = [int(token) for token in stream]
    return [(token, scored.logprob) for token, scored in zip(tokens, stream.logprobs, strict=True)]


def first_difference(a: list[Any], b: list[Any]) -> int | None:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(got: list[Any], expected: list[Any]) -> dict[str, Any]:
    difference = first_difference(got, expected)
    return {"match": difference is None, "first_difference": difference}


def delivered_in_turns(
    client: kakeya.Client, history: list[int], head: int, size: int, new: int, count: int, logprobs: bool
) -> dict[str, Any]:
    """`history[:head]` at creation, the rest in turns of `size`, `new` tokens generated after each; then a fresh
    session given the resulting history: both generate `count` tokens."""
    session = client.create_session(initial_tokens=history[:head], eos_token_ids=[])
    for start in range(head, len(history), size):
        session.append(history[start : start + size])
        if new:
            greedy(session, new)
    full = list(session.info(history_tail_tokens=65536).history_tail)
    fresh = client.create_session(initial_tokens=full, eos_token_ids=[])
    try:
        return compare(compared(session, count, logprobs), compared(fresh, count, logprobs))
    finally:
        session.close()
        fresh.close()


def run_shapes(client: kakeya.Client, histories: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """Every shape but the journal's, per history; returns the results and each history's reference tokens."""
    results: dict[str, list[dict[str, Any]]] = {}
    references = []
    for index, history in enumerate(histories):
        reference = client.create_session(initial_tokens=history, eos_token_ids=[])
        expected = compared(reference, args.new_tokens, args.logprobs)
        references.append(expected)
        # Forked once the reference's generation computed the history's K/V: the fork's cache is a copy of them.
        fork = reference.fork(prefix_tokens=len(history))
        results.setdefault("fork", []).append(compare(compared(fork, args.new_tokens, args.logprobs), expected))
        reference.close()
        fork.close()
        for size in args.turn_tokens:
            outcome = delivered_in_turns(client, history, 1, size, args.turn_new_tokens, args.new_tokens, args.logprobs)
            results.setdefault(f"turns of {size}", []).append(outcome)
        if args.token_tail:
            head = len(history) - args.token_tail
            outcome = delivered_in_turns(client, history, head, 1, 1, args.new_tokens, args.logprobs)
            results.setdefault("token by token", []).append(outcome)
        print(f"  history {index + 1}/{len(histories)}", file=sys.stderr, flush=True)
    for others in args.batch_others:
        for index, history in enumerate(histories):
            group = [history] + [histories[(index + 1 + k) % len(histories)][: 200 + 97 * k] for k in range(others)]
            sessions = [client.create_session(initial_tokens=h, eos_token_ids=[]) for h in group]
            with ThreadPoolExecutor(len(sessions)) as pool:
                outputs = list(pool.map(lambda s: compared(s, args.new_tokens, args.logprobs), sessions))
            for session in sessions:
                session.close()
            results.setdefault(f"among {others}", []).append(compare(outputs[0], references[index]))
    return {"results": results, "references": references}


def journal_shape(
    flags: list[str], histories: list[list[int]], references: list[Any], count: int, logprobs: bool
) -> list[Any]:
    """Sessions created on a journaled daemon, which stops and starts again; each restored session generates."""
    with tempfile.TemporaryDirectory(prefix="kakeya-invariance-") as state_dir:
        journaled = [*flags, "--state-dir", state_dir]
        daemon = Daemon(journaled)
        try:
            client = kakeya.Client(daemon.wait_listening())
            ids = [client.create_session(initial_tokens=h, eos_token_ids=[]).id for h in histories]
            client.close()
        finally:
            daemon.stop()
        daemon = Daemon(journaled)
        try:
            client = kakeya.Client(daemon.wait_listening())
            outcomes = []
            for session_id, expected in zip(ids, references, strict=True):
                session = kakeya.Session(client, session_id, routing_key="")
                outcomes.append(compare(compared(session, count, logprobs), expected))
                session.close()
            client.close()
        finally:
            daemon.stop()
    return outcomes


def _plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(summary["mismatches"])
    fig, ax = plt.subplots(figsize=(max(6, len(shapes) * 1.1), 3.5))
    ax.bar(shapes, [summary["mismatches"][s] for s in shapes], color="tab:red")
    ax.set_ylabel(f"mismatching histories (of {summary['histories']})")
    ax.set_ylim(0, max(1, summary["histories"]))
    ax.set_title("Greedy tokens against the history given in one block")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    text = history_tokens(args.model, args.histories * args.history_tokens)
    histories = [text[i * args.history_tokens : (i + 1) * args.history_tokens] for i in range(args.histories)]
    flags = ["--model", str(args.model), "--max-concurrent", str(max(args.batch_others, default=0) + 1)]
    flags += ["--max-sessions", str(max(64, 2 * max(args.batch_others, default=0) + 4)), *shlex.split(args.flags)]
    started = time.perf_counter()
    daemon = Daemon(flags)
    try:
        client = kakeya.Client(daemon.wait_listening())
        shapes = run_shapes(client, histories, args)
        client.close()
    finally:
        daemon.stop()
    results = shapes["results"]
    results["journal"] = journal_shape(flags, histories, shapes["references"], args.new_tokens, args.logprobs)
    summary = {
        "histories": args.histories,
        "mismatches": {shape: sum(not r["match"] for r in rows) for shape, rows in results.items()},
        "total_mismatches": sum(not r["match"] for rows in results.values() for r in rows),
        "comparisons": sum(len(rows) for rows in results.values()),
        "wall_s": time.perf_counter() - started,
    }
    print(f"  mismatches: {summary['mismatches']}", file=sys.stderr)
    path = write_results(
        "bench_invariance",
        config={**vars(args), "daemon_flags": flags},
        samples=results,
        summary=summary,
        plot=lambda png: _plot(summary, png),
        out_dir=args.results_dir,
    )
    print(path)
    return path


if __name__ == "__main__":
    main()
