"""`bench_speculative.py --histories`: each proposer through its own daemon, on held-out prompts at chosen history
lengths, as a user meets it.

One `kakeya-runtime serve` per arm (`none`, `ngram`, `dflash`, each optionally `/POLICY` for `--draft-policy`) runs
on a loopback port with the daemon's default flags plus the arm's, `--model` and any `--daemon-flags`. Every daemon
runs for a whole round, and `--rounds N` runs the bench N times over, each round in fresh daemons, so that what
one daemon process does differently from another is not read as the arms' difference: each row gives every
round's ratio apart (`speed_vs_none_by_round`) beside the pooled one. For each history rung,
prompt and repeat the arms take their turns in alternating order: a session is created with the prompt, its first
token generated (the prefill), and then a fork of it generates up to `--max-tokens` greedy tokens through the
Python SDK, stopping at the model's end-of-sequence ids as a chat does; its tokens after the first are timed. Rungs
run shortest first, so a daemon's sessions learn what drafting costs there as a user's sessions would.

Prompts (`--prompt-form`): `chat`, held-out prompts in the model's own chat template (lib/chat_prompts.py; files
no drafter was trained on): a rung of at most `SHORT_HISTORY` tokens holds questions, multi-turn chats, code
requests and tool calls of up to twice its length, a longer rung documents with a question cut to its length; or
`source`, windows of the rung's length over the held-out standard-library source.
"""

from __future__ import annotations

import argparse
import random
import shlex
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from inference_engine.config import DRAFT_POLICIES
from kv_cache_proposer.proposers import PROPOSERS
from lib.chat_prompts import ChatPromptBuilder
from lib.corpus import read_text, split_sources, stdlib_sources
from lib.daemon import Daemon
from lib.decode_arms import timed_tokens
from lib.results import write_results
from lib.tokens import spread_windows

SHORT_HISTORY = 256
"""A rung of at most this many tokens holds short chat prompts (no document)."""

SHORT_KINDS = ("question", "multi_turn", "code", "tool_call")


def parse_arms(text: str) -> list[str]:
    """`none,dflash,dflash/cost`: proposer names, each optionally with a draft policy; `none` always first."""
    arms = [a for a in text.split(",") if a]
    unknown = [a for a in arms if a.partition("/")[0] not in PROPOSERS]
    if unknown:
        raise ValueError(f"unknown proposers in --arms: {', '.join(unknown)} (from {', '.join(PROPOSERS)})")
    bad = [a for a in arms if "/" in a and (a.startswith("none/") or a.partition("/")[2] not in DRAFT_POLICIES)]
    if bad:
        raise ValueError(
            f"unknown draft policies in --arms: {', '.join(bad)} (from {', '.join(DRAFT_POLICIES)}; `none` takes none)"
        )
    return ["none", *(a for a in arms if a != "none")]


def rung_prompts(model: Path, histories: list[int], count: int, form: str, seed: int) -> dict[int, list[list[int]]]:
    """`count` held-out prompts per history rung."""
    from transformers import AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(model, local_files_only=True)
    held = split_sources(stdlib_sources())[1]
    if form == "source":
        ids = np.asarray(tokenizer.encode("".join(read_text(f) for f in held[:200])), dtype=np.int64)
        return {h: spread_windows(ids, count, h) for h in histories}
    if not getattr(tokenizer, "chat_template", None):
        raise SystemExit(f"{model} has no chat template: use --prompt-form source")
    builder = ChatPromptBuilder(tokenizer, held)
    prompts: dict[int, list[list[int]]] = {}
    for history in histories:
        rng = random.Random(seed * 100_003 + history)
        if history > SHORT_HISTORY:
            prompts[history] = [builder.build("document", rng, length=history).tokens for _ in range(count)]
            continue
        rung: list[list[int]] = []
        for _ in range(200 * count):
            tokens = builder.build(SHORT_KINDS[len(rung) % len(SHORT_KINDS)], rng).tokens
            if len(tokens) <= 2 * history:
                rung.append(tokens)
            if len(rung) == count:
                break
        else:
            raise SystemExit(f"found {len(rung)} short chat prompts within {2 * history} tokens, not {count}")
        prompts[history] = rung
    return prompts


def arm_flags(arm: str, args: argparse.Namespace) -> list[str]:
    proposer, _, policy = arm.partition("/")
    flags = ["--model", str(args.model), "--proposer", proposer, *shlex.split(args.daemon_flags)]
    if policy:
        flags += ["--draft-policy", policy]
    if proposer == "dflash" and args.dflash is not None:
        flags += ["--draft-model", str(args.dflash)]
    if proposer == "draft_model":
        flags += ["--draft-model", str(args.draft_model)]
    return flags


def generate(client: Any, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """A session over `prompt`, prefilled by its first token; a fork of it generates, timed."""
    with client.create_session(initial_tokens=prompt) as held:
        list(held.generate(1))
        with held.fork() as session:
            stream = session.generate(max_tokens)
            result = timed_tokens(stream, time.perf_counter())
            stats = stream.stats
    n = len(result["tokens"])
    result["decode_s"] = (n - 1) / result["decode_tokens_per_s"] if n > 1 else 0.0
    if stats is not None:
        result["forwards"] = stats.verifier_forward_count
        result["drafted"] = stats.draft_token_count
        result["accepted"] = stats.accepted_draft_token_count
    return result


def summarise(samples: list[dict[str, Any]], arms: list[str], histories: list[int]) -> dict[str, Any]:
    """Per arm and rung: decode tokens/s (generated tokens after the first over their seconds), tokens per
    verifier forward, drafted tokens accepted, the ratio to `none` (pooled and median of pairs), and whether every
    stream equals `none`'s."""
    by = {(s["arm"], s["history"], s["prompt"], s["repeat"], s["round"]): s for s in samples}
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for arm in arms:
        table[arm] = {}
        for history in histories:
            runs = [s for s in samples if s["arm"] == arm and s["history"] == history]
            base = [by["none", history, s["prompt"], s["repeat"], s["round"]] for s in runs]
            seconds = sum(s["decode_s"] for s in runs)
            row: dict[str, Any] = {
                "prompt_tokens": round(statistics.mean(s["prompt_tokens"] for s in runs), 1),
                "generated_tokens": round(statistics.mean(len(s["tokens"]) for s in runs), 1),
                "decode_tokens_per_s": round(_decode_rate(runs), 2) if seconds else float("nan"),
                "tokens_per_forward": _ratio(sum(len(s["tokens"]) for s in runs), sum(s["forwards"] for s in runs)),
                "drafted_per_token": _ratio(sum(s["drafted"] for s in runs), sum(len(s["tokens"]) for s in runs)),
                "acceptance_rate": _ratio(sum(s["accepted"] for s in runs), sum(s["drafted"] for s in runs)),
                "identical_to_none": all(s["tokens"] == b["tokens"] for s, b in zip(runs, base, strict=True)),
            }
            row["speed_vs_none"] = round(row["decode_tokens_per_s"] / _decode_rate(base), 3)
            pairs = [s["decode_s"] and b["decode_s"] / s["decode_s"] for s, b in zip(runs, base, strict=True)]
            row["paired_speed_vs_none"] = round(statistics.median(pairs), 3) if pairs else None
            row["speed_vs_none_by_round"] = [
                _speed_ratio([s for s in runs if s["round"] == r], [b for b in base if b["round"] == r])
                for r in sorted({s["round"] for s in runs})
            ]
            table[arm][str(history)] = row
    statement = "; ".join(
        f"{arm} at {h}: {row['speed_vs_none']:.2f}x none, {row['tokens_per_forward']:.2f} tokens/forward"
        + ("" if row["identical_to_none"] else " (streams differ from none's)")
        for arm in arms[1:]
        for h, row in table[arm].items()
    )
    return {"arms": table, "statement": statement}


def _decode_rate(samples: list[dict[str, Any]]) -> float:
    """Decode tokens/s pooled over `samples`: their tokens after the first over their seconds."""
    return sum(len(s["tokens"]) - 1 for s in samples) / max(1e-9, sum(s["decode_s"] for s in samples))


def _speed_ratio(runs: list[dict[str, Any]], base: list[dict[str, Any]]) -> float:
    """Pooled decode tokens/s of `runs` over that of `base`."""
    return round(_decode_rate(runs) / max(1e-9, _decode_rate(base)), 3)


def _ratio(part: int, whole: int) -> float:
    return round(part / max(1, whole), 3)


def plot(summary: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for arm, rows in summary["arms"].items():
        histories = [int(h) for h in rows]
        axes[0].plot(histories, [r["tokens_per_forward"] for r in rows.values()], marker="o", label=arm)
        axes[1].plot(histories, [r["speed_vs_none"] for r in rows.values()], marker="o", label=arm)
    axes[0].set_title("tokens per verifier forward")
    axes[1].set_title("decode tokens/s, ratio to none")
    axes[1].axhline(0.95, color="grey", linestyle=":", linewidth=1)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("history (tokens)")
        ax.legend(fontsize=8)
    fig.suptitle("speculative decoding through the daemon, held-out prompts, greedy")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> Path:
    """The bench; returns the results file."""
    prompts = rung_prompts(args.model, args.histories, args.prompts, args.prompt_form, args.seed)
    samples: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        samples += run_round(args, prompts, round_)
    summary = summarise(samples, args.arms, args.histories)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    config["daemon_flags_by_arm"] = {arm: arm_flags(arm, args) for arm in args.arms}
    return write_results(
        "bench_speculative",
        config=config,
        samples=samples,
        summary=summary,
        plot=lambda png: plot(summary, png),
        out_dir=args.results_dir,
    )


def run_round(args: argparse.Namespace, prompts: dict[int, list[list[int]]], round_: int) -> list[dict[str, Any]]:
    """Every rung, prompt and repeat through a fresh daemon per arm; the samples."""
    import kakeya

    daemons = {arm: Daemon(arm_flags(arm, args)) for arm in args.arms}
    samples: list[dict[str, Any]] = []
    try:
        clients = {arm: kakeya.Client(daemon.wait_listening()) for arm, daemon in daemons.items()}
        for client in clients.values():  # warm-up: first forwards allocate and load kernels
            generate(client, prompts[args.histories[0]][0], 4)
        turn = 0
        for history in args.histories:
            for index, prompt in enumerate(prompts[history]):
                for repeat in range(args.repeats):
                    order = args.arms if turn % 2 == 0 else args.arms[::-1]
                    turn += 1
                    for arm in order:
                        result = generate(clients[arm], prompt, args.max_tokens)
                        samples.append(
                            {"arm": arm, "history": history, "prompt": index, "repeat": repeat,
                             "round": round_, "prompt_tokens": len(prompt), **result}
                        )  # fmt: skip
                        print(
                            f"{arm:12s} {history:6d} #{index}.{repeat}.{round_}  {len(result['tokens']):4d} tokens  "
                            f"{result['decode_tokens_per_s']:7.1f} tok/s",
                            flush=True,
                        )
        for client in clients.values():
            client.close()
    finally:
        for daemon in daemons.values():
            daemon.stop()
    return samples
