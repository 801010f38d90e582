"""Scale-out behind HAProxy: aggregate turns/s with 1, 2 and 3 daemons sharing a PostgreSQL session journal, and the
time a session takes to resume on another daemon after its daemon is killed.

Every configuration starts, on loopback, a PostgreSQL server (a fresh database), the daemons (`--journal-url`) and
HAProxy with the shipped deploy/haproxy/haproxy.cfg (scripts/lib/cluster.py). Throughput: `--clients` threads each
own a session created through the proxy with the Python SDK (a random prompt of `--prompt-tokens`) and take turns
(append `--append-tokens`, generate `--max-tokens` greedy tokens) for `--duration-s` seconds; turns/s is the number
of turns finished divided by the wall time. Resume (with the largest daemon count): `--resume-sessions` sessions
holding `--resume-history-tokens` tokens each take one turn, the daemon holding the most of them is SIGKILLed, and
for each of its sessions the next turn is timed from the start of its append to its first generated token (HAProxy
marking the daemon down, the take-over from the journal, the prefill of the whole history); the same measure on the
session's turn before the kill is the baseline. Every history is compared with the client's record at the end.

Bounded: `--duration-s` per configuration, at most 3 daemons (the slots of the shipped configuration), loopback only.
Needs the Debian packages postgresql and haproxy (scripts/install_system_packages.sh).

Usage:
    python scripts/bench_scale_out.py [--daemons 1 2 3] [--clients 6] [--duration-s 20] [--prompt-tokens 32]
        [--append-tokens 8] [--max-tokens 8] [--resume-sessions 12] [--resume-history-tokens 512]
        [--results-dir DIR]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kakeya
from lib.cluster import (
    DAEMON_SLOTS,
    ClusterDaemon,
    PostgresServer,
    Proxy,
    fresh_database,
    haproxy_binary,
    postgres_bin_dir,
    start_daemons,
    stop_daemons,
)
from lib.results import RESULTS_DIR, write_results

_VOCAB = (3, 250)  # token ids drawn for prompts and appends (inside the bundled model's vocabulary)
_SETTLE_S = 1.5  # for HAProxy's first health checks to mark unused slots down


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--daemons", type=int, nargs="+", default=[1, 2, 3], help="daemon counts (default: 1 2 3)")
    p.add_argument("--clients", type=int, default=6, help="client threads, one session each (default: 6)")
    p.add_argument("--duration-s", type=float, default=20.0, help="seconds of turns per configuration (default: 20)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="initial history of each session (default: 32)")
    p.add_argument("--append-tokens", type=int, default=8, help="tokens appended per turn (default: 8)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per turn (default: 8)")
    p.add_argument("--resume-sessions", type=int, default=12, help="sessions of the resume measure (default: 12)")
    p.add_argument(
        "--resume-history-tokens", type=int, default=512, help="history of each resumed session (default: 512)"
    )
    p.add_argument("--seed", type=int, default=0, help="random seed of the prompts (default: 0)")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where results go (default: results/)")
    args = p.parse_args(argv)
    if any(not 1 <= n <= DAEMON_SLOTS for n in args.daemons):
        p.error(f"--daemons values must be in 1..{DAEMON_SLOTS} (the servers of deploy/haproxy/haproxy.cfg)")
    if args.clients < 1 or args.duration_s <= 0 or args.resume_sessions < 1:
        p.error("--clients and --resume-sessions must be >= 1 and --duration-s > 0")
    return args


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*_VOCAB) for _ in range(n)]


class _Cluster:
    """PostgreSQL, `count` daemons and HAProxy; a context manager that stops all of them."""

    def __init__(self, count: int) -> None:
        bin_dir, binary = postgres_bin_dir(), haproxy_binary()
        if bin_dir is None or binary is None:
            raise SystemExit("PostgreSQL and HAProxy are needed: run scripts/install_system_packages.sh")
        self.postgres = PostgresServer(bin_dir)
        self.daemons: list[ClusterDaemon] = []
        self.proxy: Proxy | None = None
        try:
            self.daemons = start_daemons(fresh_database(self.postgres), count)
            self.proxy = Proxy(binary, self.daemons)
            time.sleep(_SETTLE_S)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        stop_daemons(self.daemons)
        self.postgres.stop()

    def __enter__(self) -> _Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _throughput(args: argparse.Namespace, count: int) -> dict[str, Any]:
    """Turns/s of `args.clients` sessions taking turns through the proxy in front of `count` daemons."""
    with _Cluster(count) as cluster:
        assert cluster.proxy is not None
        latencies: list[float] = []
        errors: list[str] = []
        mismatches = 0
        lock = threading.Lock()
        stop_at = time.monotonic() + args.duration_s

        def client(index: int) -> None:
            nonlocal mismatches
            rng = random.Random(args.seed * 1000 + index)
            assert cluster.proxy is not None
            with kakeya.Client(cluster.proxy.address, timeout_s=120) as sdk:
                known = _tokens(rng, args.prompt_tokens)
                session = sdk.create_session(initial_tokens=known)
                while time.monotonic() < stop_at:
                    started = time.perf_counter()
                    try:
                        append = _tokens(rng, args.append_tokens)
                        session.append(append)
                        known += append
                        known += list(session.generate(args.max_tokens))
                    except kakeya.KakeyaError as exc:
                        with lock:
                            errors.append(str(exc))
                        return
                    with lock:
                        latencies.append(time.perf_counter() - started)
                history = list(session.info(history_tail_tokens=len(known)).history_tail)
                with lock:
                    mismatches += history != known
                session.close()

        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall_s = time.perf_counter() - started
        per_daemon = {d.name: int(d.metrics().get("kakeya_session_opened_total", 0)) for d in cluster.daemons}
    turns = len(latencies)
    return {
        "daemons": count,
        "turns": turns,
        "wall_s": wall_s,
        "turns_per_s": turns / wall_s,
        "turn_latency_p50_s": statistics.median(latencies) if latencies else None,
        "errors": len(errors),
        "error_messages": errors[:5],
        "history_mismatches": mismatches,
        "sessions_per_daemon": per_daemon,
        "latencies_s": latencies,
    }


def _turn_to_first_token_s(session: kakeya.Session, append: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """One turn (append, generate); returns the time from the append's start to the first generated token, and the
    generated tokens."""
    started = time.perf_counter()
    session.append(append)
    stream = session.generate(max_tokens)
    first = next(stream)
    elapsed = time.perf_counter() - started
    return elapsed, [first, *stream]


def _resume(args: argparse.Namespace, count: int) -> dict[str, Any]:
    """Time to first token of the turn after the SIGKILL of the daemon holding the sessions, against the turn before."""
    rng = random.Random(args.seed + 7)
    with (
        _Cluster(count) as cluster,
        kakeya.Client(cluster.proxy.address if cluster.proxy else "", timeout_s=120) as sdk,
    ):
        sessions = []
        for _ in range(args.resume_sessions):
            known = _tokens(rng, args.resume_history_tokens)
            session = sdk.create_session(initial_tokens=known)
            known += list(session.generate(args.max_tokens))
            sessions.append((session, known))
        before: dict[str, float] = {}
        for session, known in sessions:
            append = _tokens(rng, args.append_tokens)
            elapsed, generated = _turn_to_first_token_s(session, append, args.max_tokens)
            known += append + generated
            before[session.id] = elapsed
        holders = {
            d.name: {str(r["session_id"]) for r in d.records() if r.get("msg") == "session created"}
            for d in cluster.daemons
        }
        victim = max(cluster.daemons, key=lambda d: len(holders[d.name]))
        moved = [(s, k) for s, k in sessions if s.id in holders[victim.name]]
        killed_at = time.perf_counter()
        victim.kill()
        samples: list[dict[str, Any]] = []
        for session, known in moved:
            append = _tokens(rng, args.append_tokens)
            waited_s = time.perf_counter() - killed_at
            # The append is the session's first call after the kill: the take-over happens there, the prefill of
            # the whole history before the first token.
            elapsed, generated = _turn_to_first_token_s(session, append, args.max_tokens)
            known += append + generated
            samples.append(
                {
                    "session_id": session.id,
                    "resume_turn_first_token_s": elapsed,
                    "before_turn_first_token_s": before[session.id],
                    "since_kill_s": waited_s,
                }
            )
        mismatches = sum(list(s.info(history_tail_tokens=len(k)).history_tail) != k for s, k in sessions)
        takeovers = sum(d.metrics()["kakeya_cluster_session_takeovers_total"] for d in cluster.daemons if d.alive)
    resume = [float(s["resume_turn_first_token_s"]) for s in samples]
    baseline = [float(s["before_turn_first_token_s"]) for s in samples]
    return {
        "daemons": count,
        "killed": victim.name,
        "moved_sessions": len(samples),
        "takeovers": int(takeovers),
        "history_tokens": args.resume_history_tokens,
        "resume_turn_first_token_p50_s": statistics.median(resume) if resume else None,
        "resume_turn_first_token_max_s": max(resume) if resume else None,
        "before_turn_first_token_p50_s": statistics.median(baseline) if baseline else None,
        "history_mismatches": mismatches,
        "samples": samples,
    }


def _plot(throughput: list[dict[str, Any]], resume: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar([str(r["daemons"]) for r in throughput], [r["turns_per_s"] for r in throughput], color="tab:blue")
    left.set_xlabel("daemons behind HAProxy")
    left.set_ylabel("turns/s (all clients)")
    left.set_title("aggregate throughput")
    samples = resume["samples"]
    xs = range(len(samples))
    right.bar([x - 0.2 for x in xs], [s["before_turn_first_token_s"] for s in samples], width=0.4, label="turn before")
    right.bar([x + 0.2 for x in xs], [s["resume_turn_first_token_s"] for s in samples], width=0.4, label="after kill")
    right.set_xlabel("session of the killed daemon (in resume order)")
    right.set_ylabel("append to first token (s)")
    right.set_title(f"resume on another daemon ({resume['history_tokens']}-token histories)")
    right.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    throughput = []
    for count in args.daemons:
        run = _throughput(args, count)
        print(f"{count} daemon(s): {run['turns_per_s']:.2f} turns/s ({run['turns']} turns, {run['errors']} errors)")
        throughput.append(run)
    resume = _resume(args, max(args.daemons))
    print(
        f"resume after SIGKILL: p50 {resume['resume_turn_first_token_p50_s']} s to first token "
        f"(before: {resume['before_turn_first_token_p50_s']} s), {resume['moved_sessions']} sessions moved"
    )
    single = throughput[0]["turns_per_s"]
    summary = {
        "throughput": [{k: v for k, v in r.items() if k != "latencies_s"} for r in throughput],
        "speedup_vs_first": {str(r["daemons"]): r["turns_per_s"] / single for r in throughput},
        "resume": {k: v for k, v in resume.items() if k != "samples"},
        "total_errors": sum(r["errors"] for r in throughput),
        "total_history_mismatches": sum(r["history_mismatches"] for r in throughput) + resume["history_mismatches"],
    }
    path = write_results(
        "bench_scale_out",
        config=dict(vars(args)),
        samples={
            "turn_latencies_s": {str(r["daemons"]): r["latencies_s"] for r in throughput},
            "resume": resume["samples"],
        },
        summary=summary,
        plot=lambda png: _plot(throughput, resume, png),
        out_dir=args.results_dir,
    )
    print(path)
    return path


if __name__ == "__main__":
    main()
