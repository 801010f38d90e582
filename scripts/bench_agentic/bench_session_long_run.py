"""Long agent-shaped session through the Python SDK, side by side with a stateless re-prefill baseline.

Every turn appends `--user-tokens-per-turn` tokens (a tool result or a user message) and generates `--max-tokens`
tokens greedily. The session arm keeps one session and appends only the new tokens. The baseline arm, in the same
run and against the same daemon, does what a stateless server does: every turn it creates a fresh session holding
the whole history (re-prefill), generates the same number of tokens, and closes it. Both arms record, per turn,
the client's wall latency (append + generation), the server's prefill seconds, generated tokens, history length,
`kv_live_bytes` and the invariant counters. Turns are grouped into `--buckets` consecutive buckets with p50/p95.

Summary: `kv_drift` = (max - min) / min of the session arm's bucket p50 `kv_live_bytes`; `latency_p50_drift` =
last-bucket p50 / first-bucket p50 of the session arm's wall latency; `invariant_violations` = INV-1 + INV-2
counters over every session of both arms; `baseline_over_session_latency_p50_last_bucket` = the baseline's p50
wall latency over the session's, in the last bucket.

Writes results/bench_session_long_run_<stamp>.json (config, environment, per-turn samples, buckets, summary) and a
PNG of latency and KV bytes against turn for both arms.

Usage:
    python scripts/bench_agentic/bench_session_long_run.py [--turns 200] [--user-tokens-per-turn 24]
        [--max-tokens 16] [--initial-tokens 256] [--kv-strategy sink_window] [--sink 4] [--window 1024]
        [--duration-s 0] [--buckets 4] [--baseline-every 1] [--address HOST:PORT | --model NAME|DIR|GGUF]
        [--out results]

    Without --address it starts `kakeya-runtime serve` on a free loopback port, serving --model (default:
    kakeya-tiny), and stops it at the end.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import kakeya
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lib.daemon import Daemon
from lib.model_option import add_model_option
from lib.results import write_results

ROOT = Path(__file__).resolve().parents[2]
NAME = "bench_session_long_run"


@dataclass(slots=True)
class Sample:
    """One turn of one arm."""

    arm: str
    turn: int
    wall_s: float
    prefill_s: float
    prefill_tokens: int
    generated_tokens: int
    history_length: int
    kv_live_bytes: int
    resident_tokens: int
    evicted_tokens: int
    inv1_violations: int
    inv2_violations: int
    matches_session: bool | None = None


def run_turns(args: argparse.Namespace, client: kakeya.Client) -> list[Sample]:
    rng = random.Random(args.seed)
    draw = lambda n: [rng.randrange(args.token_id_limit) for _ in range(n)]  # noqa: E731
    create = {"kv_strategy": args.kv_strategy}
    if args.kv_strategy == "sink_window":
        create |= {"sink_tokens": args.sink, "window_tokens": args.window}
    history = draw(args.initial_tokens)
    samples: list[Sample] = []
    started = time.monotonic()
    with client.create_session(initial_tokens=history, label="bench-session", **create) as session:
        for turn in tqdm(range(args.turns), desc="turns", unit="turn", disable=args.quiet):
            user = draw(args.user_tokens_per_turn)
            history += user
            begin = time.perf_counter()
            session.append(user)
            tokens = list(session.generate(args.max_tokens))
            wall = time.perf_counter() - begin
            samples.append(_sample("session", turn, wall, session.last_generation, session.info()))
            if turn % args.baseline_every == 0 or turn == args.turns - 1:
                begin = time.perf_counter()
                fresh = client.create_session(initial_tokens=history, label="bench-baseline", **create)
                baseline_tokens = list(fresh.generate(args.max_tokens))
                wall = time.perf_counter() - begin
                sample = _sample("baseline", turn, wall, fresh.last_generation, fresh.info())
                sample.matches_session = baseline_tokens == tokens
                fresh.close()
                samples.append(sample)
            history += tokens
            if args.duration_s and time.monotonic() - started >= args.duration_s:
                break  # checked after a turn, so every run has at least one
    return samples


def _sample(arm: str, turn: int, wall: float, stats: kakeya.GenerationStats | None, info: kakeya.SessionInfo) -> Sample:
    if stats is None:
        raise RuntimeError(f"{arm} turn {turn}: the generation ended without statistics")
    return Sample(
        arm=arm,
        turn=turn,
        wall_s=wall,
        prefill_s=stats.prefill_duration_s,
        prefill_tokens=stats.prefill_token_count,
        generated_tokens=stats.generated_token_count,
        history_length=info.history_length,
        kv_live_bytes=info.kv_live_bytes,
        resident_tokens=info.resident_token_count,
        evicted_tokens=info.evicted_token_count,
        inv1_violations=info.inv1_violations,
        inv2_violations=info.inv2_violations,
    )


def _percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile `q` (0..100)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (position - low))


def buckets(samples: list[Sample], count: int) -> list[dict[str, Any]]:
    """Per bucket of consecutive turns, per arm: p50/p95 wall latency, p50 prefill seconds and KV bytes."""
    turns = sorted({s.turn for s in samples if s.arm == "session"})
    size = max(1, -(-len(turns) // count))
    out = []
    for index in range(0, len(turns), size):
        span = set(turns[index : index + size])
        row: dict[str, Any] = {"first_turn": min(span), "last_turn": max(span)}
        for arm in ("session", "baseline"):
            rows = [s for s in samples if s.arm == arm and s.turn in span]
            if not rows:
                continue
            row[arm] = {
                "turns": len(rows),
                "wall_s_p50": _percentile([s.wall_s for s in rows], 50),
                "wall_s_p95": _percentile([s.wall_s for s in rows], 95),
                "prefill_s_p50": _percentile([s.prefill_s for s in rows], 50),
                "kv_live_bytes_p50": _percentile([s.kv_live_bytes for s in rows], 50),
                "history_length_p50": _percentile([s.history_length for s in rows], 50),
            }
        out.append(row)
    return out


def summarize(samples: list[Sample], rows: list[dict[str, Any]]) -> dict[str, Any]:
    session = [s for s in samples if s.arm == "session"]
    baseline = [s for s in samples if s.arm == "baseline"]
    kv = [row["session"]["kv_live_bytes_p50"] for row in rows]
    first, last = rows[0], rows[-1]
    violations = max(s.inv1_violations + s.inv2_violations for s in session) + sum(
        s.inv1_violations + s.inv2_violations for s in baseline
    )
    summary: dict[str, Any] = {
        "turns": len(session),
        "final_history_length": session[-1].history_length,
        "buckets": len(rows),
        "kv_drift": (max(kv) - min(kv)) / min(kv) if min(kv) else None,
        "session_latency_p50_first_bucket_s": first["session"]["wall_s_p50"],
        "session_latency_p50_last_bucket_s": last["session"]["wall_s_p50"],
        "latency_p50_drift": last["session"]["wall_s_p50"] / first["session"]["wall_s_p50"],
        "invariant_violations": violations,
        "baseline_turns": len(baseline),
        "baseline_token_agreement": sum(bool(s.matches_session) for s in baseline) / len(baseline)
        if baseline
        else None,
    }
    if "baseline" in first and "baseline" in last:
        summary |= {
            "baseline_latency_p50_first_bucket_s": first["baseline"]["wall_s_p50"],
            "baseline_latency_p50_last_bucket_s": last["baseline"]["wall_s_p50"],
            "baseline_over_session_latency_p50_last_bucket": last["baseline"]["wall_s_p50"]
            / last["session"]["wall_s_p50"],
        }
    summary["checks"] = {
        "kv_drift_below_10_percent": summary["kv_drift"] is not None and summary["kv_drift"] < 0.10,
        "latency_p50_drift_at_most_1_5": summary["latency_p50_drift"] <= 1.5,
        "zero_invariant_violations": violations == 0,
    }
    return summary


def plot(samples: list[Sample], summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7.5), sharex=True)
    styles = {
        "session": ("tab:blue", "session (append only the new tokens)"),
        "baseline": ("tab:red", "stateless baseline (re-prefill the history)"),
    }
    for arm, (color, label) in styles.items():
        rows = [s for s in samples if s.arm == arm]
        if not rows:
            continue
        turns = [s.turn for s in rows]
        top.plot(turns, [s.wall_s * 1000 for s in rows], ".", ms=3, color=color, label=label)
        bottom.plot(turns, [s.kv_live_bytes / 1024 for s in rows], "-", color=color, label=label)
    top.set_yscale("log")
    top.set_ylabel("turn wall latency (ms, log)")
    ratio = summary.get("baseline_over_session_latency_p50_last_bucket")
    title = f"{summary['turns']} turns, history {summary['final_history_length']} tokens"
    if ratio is not None:
        title += f"; baseline / session p50 at the last bucket: {ratio:.1f}x"
    top.set_title(title)
    top.legend(loc="upper left", fontsize="small")
    bottom.set_ylabel("kv_live_bytes (KiB)")
    bottom.set_xlabel("turn")
    history = bottom.twinx()
    session = [s for s in samples if s.arm == "session"]
    history.plot([s.turn for s in session], [s.history_length for s in session], ":", color="gray")
    history.set_ylabel("history length (tokens, dotted)")
    bottom.legend(loc="center left", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--user-tokens-per-turn", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated per turn")
    parser.add_argument("--initial-tokens", type=int, default=256, help="history the session starts with")
    parser.add_argument("--kv-strategy", choices=[s.value for s in kakeya.KvStrategy], default="sink_window")
    parser.add_argument("--sink", type=int, default=4)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument(
        "--duration-s", type=float, default=0.0, help="end with the turn that reaches this many seconds (0: no limit)"
    )
    parser.add_argument("--buckets", type=int, default=4)
    parser.add_argument("--baseline-every", type=int, default=1, help="run the baseline arm every N turns")
    parser.add_argument("--token-id-limit", type=int, default=256, help="workload token ids are drawn below this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--address", help="use a running daemon instead of starting one")
    add_model_option(parser, "the model the started daemon serves (not used with --address)")
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.address is not None:  # the running daemon's model, whatever --model says
        args.model = args.model_name = None
    for name in ("turns", "user_tokens_per_turn", "max_tokens", "buckets", "baseline_every", "window"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.initial_tokens < 1 or args.sink < 0 or args.duration_s < 0:
        parser.error("--initial-tokens must be >= 1, --sink and --duration-s >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    daemon = None
    if args.address is None:
        flags = ["--kv-strategy", args.kv_strategy, "--sink", str(args.sink), "--window", str(args.window)]
        daemon = Daemon([*flags, "--model", str(args.model)])
        args.address = daemon.wait_listening()
    try:
        with kakeya.Client(args.address, timeout_s=300.0) as client:
            client.wait_until_ready(60.0)
            samples = run_turns(args, client)
    finally:
        if daemon is not None:
            daemon.stop()
    rows = buckets(samples, args.buckets)
    summary = summarize(samples, rows)
    json_path = write_results(
        NAME,
        config=vars(args),
        samples=[asdict(s) for s in samples],
        summary=summary,
        plot=lambda png: plot(samples, summary, png),
        out_dir=args.out,
        environment_extra={
            "kakeya_sdk": kakeya.__version__,
            "daemon_command": daemon.command if daemon else None,
            "address": args.address,
        },
        extra={"buckets": rows},
    )
    print(json.dumps(summary, indent=2))
    print(f"wrote {json_path} and {json_path.with_suffix('.png').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
