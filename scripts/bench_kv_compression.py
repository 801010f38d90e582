"""KV compression benchmark: rate–distortion on the model's real K/V, then the compressors through the daemon.

Part 1 (in process, no daemon): K/V captured from real forwards of `--model` over held-out text. For every
KakeyaLattice compressor and Q of `--d4-q` / `--e8-q` it measures bits per value (packed bytes actually held, codes
+ fp16 norm and scale + escapes) and relative MSE (sum of squared errors over sum of squares, K and V apart), next to
the common alternatives on the same tensors: affine 4- and 8-bit group-64 quantisation (mlx's `mx.quantize`, as
mlx-lm's quantised KV cache does it), fp8 e4m3 with a per-tensor scale (as vLLM's fp8 KV cache does it) and bf16.

Part 2 (one daemon on 127.0.0.1 on `--backend`, each session choosing its compressor): for every `--variants` entry
and `none`, in the same run: bytes per token held by a parked session, NIAH recall at each `--lengths` rung
(documents and scoring of `scripts/eval_niah.py`, the same `--samples` documents for every variant, so the documents
on which a variant and `none` disagree are counted too), greedy-token agreement with `none` over
`--agreement-tokens` tokens, and time to first token of a parked session (a one-token append to a parked 2,048-token
session). Decode speed: one session per variant over a 2,048-token prompt, then `--speed-rounds` short rounds in
which every session in turn generates `--speed-tokens` tokens (the order reversed every other round), so each
variant's round sits next to `none`'s in time: the speed ratio is the median of the per-round ratios to `none`,
which cancels most of a shared machine's drift. Tokens/s and the daemon's CPU seconds per token (read from /proc)
are counted from each round's first token on: the first token of a generation resumes a parked session (a
compressed one decodes its packed K/V then), which the time to first token of a parked session measures apart.

Part 3: one daemon per variant with the same `--kv-budget-bytes` (`--budget-sessions` dense 2,048-token sessions
and a quarter more, so the dense count is not on an edge) and 2,048-token sessions created until the first is
evicted. The budget charges every session all it holds: a parked one its bytes between generations, the generating
one its peak (`kv_peak_bytes`: a compressed session's unpacked residents too), so the sessions held are
`(budget - peak) // parked bytes + 1`: the summary puts the measured count next to that expectation and the session
growth next to the byte ratio.

Writes `results/bench_kv_compression_<stamp>.json` and a PNG (rate–distortion curves of K and V, bytes per token).

Usage:
    python scripts/bench_kv_compression.py [--smoke] [--model NAME|DIR|GGUF] [--lengths 512,1024,2048] [--samples 2]
        [--variants kakeya_d4:38,kakeya_d4:10,kakeya_e8:38] [--dtype float32] [--speed-rounds 16]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

import kakeya
import torch
from tqdm import tqdm
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eval_niah import heldout_lines
from lib.daemon import Daemon
from lib.model_option import add_model_option
from lib.niah import build_document
from lib.paired_speed import paired_rounds
from lib.rate_distortion import capture_kv, lattice_vs_affine4, rate_distortion
from lib.results import RESULTS_DIR, write_results

SESSION_TOKENS = 2048


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every option's default after its help."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
    add_model_option(p, "the model of part 1 and of the daemons")
    p.add_argument("--dtype", default="float32", help="dtype the daemon serves in (float32 is fast on CPU)")
    p.add_argument(
        "--backend", choices=("torch", "mlx"), default="torch", help="backend of the daemons (parts 2 and 3)"
    )
    p.add_argument("--capture-tokens", type=int, default=1024, help="tokens of K/V captured for part 1")
    p.add_argument("--d4-q", default="2,5,10,19,38,76", help="D4 q_range values of the rate–distortion sweep")
    p.add_argument("--e8-q", default="2,5,10,19,37,76", help="E8 q_range values of the rate–distortion sweep")
    p.add_argument(
        "--variants",
        default="kakeya_d4:38,kakeya_d4:10,kakeya_e8:38",
        help="compressor:Q pairs compared with none through the daemon",
    )
    p.add_argument("--lengths", default="512,1024,2048", help="NIAH context lengths (tokens)")
    p.add_argument("--samples", type=int, default=20, help="NIAH documents per length (depths spread evenly)")
    p.add_argument("--agreement-tokens", type=int, default=256, help="greedy tokens compared with none")
    p.add_argument(
        "--speed-rounds", type=int, default=16, help="interleaved decode-speed rounds (median of per-round ratios)"
    )
    p.add_argument("--speed-tokens", type=int, default=64, help="tokens each session generates per speed round")
    p.add_argument("--budget-sessions", type=int, default=4, help="dense 2,048-token sessions the part-3 budget fits")
    p.add_argument("--max-sessions", type=int, default=40, help="most sessions part 3 creates per variant")
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads of the daemons (serve --threads; 0: the daemon's default). One thread leaves the other "
        "core to this client, which keeps the decode-speed ratios steadier on a two-core machine",
    )
    p.add_argument("--smoke", action="store_true", help="tiny sizes: a seconds-long run for tests")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    if args.smoke:
        args.capture_tokens, args.d4_q, args.e8_q = 128, "10,38", "10,37"
        args.lengths, args.samples, args.agreement_tokens = "128", 1, 16
        args.speed_rounds, args.speed_tokens = 1, 8
        args.budget_sessions, args.max_sessions, args.variants = 3, 20, "kakeya_d4:38"
    args.lengths = [int(x) for x in str(args.lengths).split(",")]
    args.d4_q = [int(x) for x in str(args.d4_q).split(",")]
    args.e8_q = [int(x) for x in str(args.e8_q).split(",")]
    args.variants = [(name, int(q)) for name, q in (v.split(":") for v in args.variants.split(","))]
    return args


# -- part 2: through the daemon ------------------------------------------------------------------------------
def _create(variant: tuple[str, int]) -> dict[str, Any]:
    name, q = variant
    return {"kv_compressor": name} if name == "none" else {"kv_compressor": name, "kv_q_range": q}


def _label(variant: tuple[str, int]) -> str:
    return variant[0] if variant[0] == "none" else f"{variant[0]}:{variant[1]}"


def _daemon_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--model", str(args.model), "--backend", args.backend, "--dtype", args.dtype]
    return flags + (["--threads", str(args.threads)] if args.threads else [])


def decode_speed(
    args: argparse.Namespace, client: kakeya.Client, pid: int, prompt: list[int], variants: list[tuple[str, int]]
) -> dict[str, Any]:
    """One session per variant over `prompt`, then `--speed-rounds` paired rounds of `--speed-tokens` tokens."""
    sessions = {_label(v): client.create_session(initial_tokens=prompt, label="bench", **_create(v)) for v in variants}
    try:
        for session in sessions.values():
            list(session.generate(1))  # prefill, not timed
        return paired_rounds(sessions, "none", rounds=args.speed_rounds, tokens=args.speed_tokens, pid=pid)
    finally:
        for session in sessions.values():
            session.close()


def dense_session_bytes(client: kakeya.Client, text: list[int], length: int) -> int:
    """KV bytes a parked dense session of `length` tokens holds (what part 3's budget is sized in)."""
    with client.create_session(initial_tokens=text[: length - 1], label="bench", kv_compressor="none") as session:
        list(session.generate(1))
        return int(session.info().kv_live_bytes)


def daemon_runs(
    args: argparse.Namespace, client: kakeya.Client, pid: int, tokenizer: Any, lines: list[list[int]]
) -> dict[str, Any]:
    variants = [("none", 0), *args.variants]
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    rng = random.Random(args.seed)
    depths = [i / max(1, args.samples - 1) for i in range(args.samples)] if args.samples > 1 else [0.5]
    documents = [
        (length, depth, build_document(lines, encode, length, [depth], rng))
        for length in args.lengths
        for depth in depths
    ]
    prompt = [t for line in lines[:400] for t in line][: max(args.lengths)]
    out: dict[str, Any] = {"niah": [], "generation": {}}
    for variant in tqdm(variants, desc="daemon", unit="variant", file=sys.stderr):
        label = _label(variant)
        for length, depth, doc in documents:
            with client.create_session(initial_tokens=doc.prompt, label="bench", **_create(variant)) as session:
                text = tokenizer.decode(list(session.generate(10)))
            out["niah"].append(
                {"variant": label, "length": length, "depth": depth, "recalled": doc.needles[0].value in text}
            )
        with client.create_session(initial_tokens=prompt, label="bench", **_create(variant)) as session:
            stream = session.generate(args.agreement_tokens)
            tokens = list(stream)
            stats = stream.stats
            parked = session.info()
            session.append(prompt[:1])
            started = time.perf_counter()
            resumed = session.generate(1)
            list(resumed)
            parked_ttft_client = time.perf_counter() - started
        assert stats is not None and resumed.stats is not None
        decode_s = stats.total_duration_s - stats.time_to_first_token_s
        out["generation"][label] = {
            "tokens": tokens,
            "history_tokens": parked.history_length,
            "kv_live_bytes": parked.kv_live_bytes,
            "kv_compressed_bytes": parked.kv_compressed_bytes,
            "kv_dense_equivalent_bytes": parked.kv_dense_equivalent_bytes,
            "kv_escaped_blocks": parked.kv_escaped_blocks,
            "bytes_per_token": parked.kv_live_bytes / parked.history_length,
            "decode_tokens_per_s": (len(tokens) - 1) / decode_s if decode_s > 0 else None,
            "parked_ttft_s": resumed.stats.time_to_first_token_s,
            "parked_ttft_client_s": parked_ttft_client,
        }
    out["decode_speed"] = decode_speed(args, client, pid, prompt, variants)
    text = [t for line in lines for t in line]
    out["dense_session_bytes"] = dense_session_bytes(client, text, SESSION_TOKENS if not args.smoke else 128)
    return out


def sessions_under_budget(
    args: argparse.Namespace, variant: tuple[str, int], budget: int, lines: list[list[int]]
) -> dict[str, Any]:
    """2,048-token sessions a daemon holds under `budget` KV bytes before it evicts the first, and the bytes one
    of them holds parked."""
    length = SESSION_TOKENS if not args.smoke else 128
    flags = [*_daemon_flags(args), "--kv-budget-bytes", str(budget)]
    if variant[0] != "none":
        flags += ["--kv-compressor", variant[0], "--kv-q-range", str(variant[1])]
    text = [t for line in lines for t in line]
    daemon = Daemon(flags)
    try:
        with kakeya.Client(daemon.wait_listening(), timeout_s=600.0) as client:
            sessions: list[Any] = []
            session_bytes = peak_bytes = 0
            for i in range(args.max_sessions):
                start = (i * 997) % max(1, len(text) - length)
                session = client.create_session(initial_tokens=text[start : start + length - 1])
                list(session.generate(1))
                if not sessions:
                    described = session.info()
                    session_bytes, peak_bytes = int(described.kv_live_bytes), int(described.kv_peak_bytes)
                sessions.append(session)
                alive = 0
                for s in sessions:
                    try:
                        s.info()
                        alive += 1
                    except kakeya.SessionNotFound:
                        pass
                if alive < len(sessions):
                    return {"held": alive, "capped": False, "session_bytes": session_bytes, "peak_bytes": peak_bytes}
            return {"held": len(sessions), "capped": True, "session_bytes": session_bytes, "peak_bytes": peak_bytes}
    finally:
        daemon.stop()


def _niah_discordant(rows: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per variant and rung: documents recalled by exactly one of the variant and `none` (the same documents)."""
    base = {(r["length"], r["depth"]): r["recalled"] for r in rows if r["variant"] == "none"}
    out: dict[str, dict[str, int]] = {}
    for r in rows:
        rung = out.setdefault(r["variant"], {}).setdefault(str(r["length"]), 0)
        out[r["variant"]][str(r["length"])] = rung + int(r["recalled"] != base[(r["length"], r["depth"])])
    return out


def _budget_row(held: dict[str, Any], none: dict[str, Any], budget: int) -> dict[str, Any]:
    """Part 3 of one variant: sessions held, what the bytes predict (parked sessions beside one generating at its
    peak), and the growth next to the byte ratio."""
    expected = (budget - held["peak_bytes"]) // held["session_bytes"] + 1 if held["session_bytes"] else None
    return {
        "held": held["held"],
        "capped_by_max_sessions": held["capped"],
        "session_bytes": held["session_bytes"],
        "generating_peak_bytes": held["peak_bytes"],
        "expected_held": expected,
        "growth_vs_none": held["held"] / none["held"],
        "byte_ratio_vs_none": none["session_bytes"] / held["session_bytes"] if held["session_bytes"] else None,
    }


def summarize(
    rd: list[dict[str, Any]], runs: dict[str, Any], held: dict[str, dict[str, Any]], budget: int, dtype: str
) -> dict[str, Any]:
    gen = runs["generation"]
    base = gen["none"]
    bf16_bytes_per_token = base["kv_dense_equivalent_bytes"] / base["history_tokens"] * (2 / _itemsize(dtype))
    hits: dict[str, dict[str, list[bool]]] = {}
    for row in runs["niah"]:
        hits.setdefault(row["variant"], {}).setdefault(str(row["length"]), []).append(bool(row["recalled"]))
    recall = {v: {k: sum(x) / len(x) for k, x in rungs.items()} for v, rungs in hits.items()}
    discordant = _niah_discordant(runs["niah"])
    speed = runs["decode_speed"]
    base_speed = speed["none"]
    per_variant = {}
    for label, g in gen.items():
        agree = [a == b for a, b in zip(g["tokens"], base["tokens"], strict=False)]
        first_diff = next((i for i, same in enumerate(agree) if not same), None)
        s = speed[label]
        cpu_ratio = (
            base_speed["cpu_s_per_token"] / s["cpu_s_per_token"]
            if s["cpu_s_per_token"] and base_speed["cpu_s_per_token"]
            else None
        )
        budget_row = _budget_row(held[label], held["none"], budget) if label in held else None
        per_variant[label] = {
            "bytes_per_token": g["bytes_per_token"],
            "fewer_bytes_than_bf16": bf16_bytes_per_token / g["bytes_per_token"],
            "fewer_bytes_than_served_dtype": base["bytes_per_token"] / g["bytes_per_token"],
            "greedy_agreement": sum(agree) / len(agree) if agree else None,
            "first_divergence": first_diff,
            "decode_tokens_per_s": s["tokens_per_s"],
            "decode_speed_vs_none": s["speed_vs_baseline"],  # the median of the per-round ratios
            "decode_cpu_s_per_token": s["cpu_s_per_token"],
            "decode_cpu_speed_vs_none": cpu_ratio,
            "parked_ttft_s": g["parked_ttft_s"],
            "escaped_blocks": g["kv_escaped_blocks"],
            "niah_recall": recall.get(label, {}),
            "niah_discordant_with_none": discordant.get(label, {}),
            "sessions_held_under_budget": budget_row["held"] if budget_row else None,
            "budget": budget_row,
            # The session growth over the compression ratio of the bytes held per token (1.0: growth equals it).
            "budget_growth_vs_compression_ratio": (
                budget_row["growth_vs_none"] / (base["bytes_per_token"] / g["bytes_per_token"]) if budget_row else None
            ),
        }
    return {
        "bf16_bytes_per_token": bf16_bytes_per_token,
        "variants": per_variant,
        "lattice_vs_affine4": lattice_vs_affine4(rd),
    }


def _itemsize(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype, 4)


def plot(rd: list[dict[str, Any]], summary: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax, tensor in zip(axes[:2], ("K", "V"), strict=True):
        for method in sorted({p["method"] for p in rd}):
            pts = sorted(
                (p["bits_per_value"], p["rel_mse"]) for p in rd if p["tensor"] == tensor and p["method"] == method
            )
            ax.plot(*zip(*pts, strict=True), marker="o", label=method)
        ax.set(xlabel="bits per value (held)", ylabel="relative MSE", yscale="log", title=f"rate–distortion, {tensor}")
        ax.legend(fontsize=7)
    variants = summary["variants"]
    names = list(variants)
    axes[2].bar(names, [variants[n]["bytes_per_token"] for n in names])
    axes[2].set(ylabel="KV bytes per token held (parked)", title="bytes per token")
    axes[2].tick_params(axis="x", rotation=20)
    fig.savefig(png, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    lines = heldout_lines(tokenizer)
    capture = [t for line in lines[-600:] for t in line][: args.capture_tokens]
    rd = rate_distortion(capture_kv(args.model, capture), args.d4_q, args.e8_q)
    daemon = Daemon(_daemon_flags(args))
    try:
        with kakeya.Client(daemon.wait_listening(), timeout_s=600.0) as client:
            runs = daemon_runs(args, client, daemon.process.pid, tokenizer, lines)
    finally:
        daemon.stop()
    daemon_done = time.monotonic()
    one_session = runs["dense_session_bytes"]
    budget = one_session * args.budget_sessions + one_session // 4
    held = {
        _label(v): sessions_under_budget(args, v, budget, lines)
        for v in tqdm([("none", 0), *args.variants], desc="budget", file=sys.stderr)
    }
    summary = summarize(rd, runs, held, budget, args.dtype)
    summary["kv_budget_bytes"] = budget
    summary["duration_s"] = {
        "total": time.monotonic() - started,
        "rate_distortion_and_daemon": daemon_done - started,
        "budget": time.monotonic() - daemon_done,
    }
    path = write_results(
        "bench_kv_compression",
        config=vars(args),
        samples={
            "rate_distortion": rd,
            "niah": runs["niah"],
            "generation": runs["generation"],
            "decode_speed": runs["decode_speed"],
            "budget": held,
        },
        summary=summary,
        plot=lambda png: plot(rd, summary, png),
        out_dir=args.results_dir,
    )
    for label, row in summary["variants"].items():
        print(label, {k: v for k, v in row.items() if k != "niah_recall"}, row["niah_recall"])
    print("\n".join(summary["lattice_vs_affine4"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
