"""The summary of `scripts/bench_decode.py`: per backend, each arm's median decode rate and its ratio to the bare
loop of the same weights, prefill rates and their ratio to one bare forward, whether tokens agree, per weights
choice the daemon's speed against the float32 daemon's, and per compiled arm its compile time and its speed and
tokens against its scripted self."""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from lib.tokens import shared_prefix

BARE = {"torch": "bare_loop", "mlx": "mlx_lm"}
COMPILED = "+compiled"  # the suffix of an arm's name whose decode steps are compiled


def named(arm: str, weights: str) -> str:
    """An arm's name at a weights choice: float32 keeps the plain name, the others carry `@<weights>`."""
    return arm if weights == "float32" else f"{arm}@{weights}"


def unnamed(name: str) -> tuple[str, str]:
    """The arm and the weights choice of a name `named` gave."""
    arm, _, weights = name.partition("@")
    return arm, weights or "float32"


def summarize(samples: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for backend in args.backends:
        decode = [s for s in samples["decode"] if s["backend"] == backend]
        prefill = [s for s in samples["prefill"] if s["backend"] == backend]
        weights_of = {s["arm"]: s["weights"] for s in decode + prefill}
        rates: dict[str, dict[int, float]] = {}
        for sample in decode:
            rates.setdefault(sample["arm"], {}).setdefault(sample["history"], [])  # type: ignore[arg-type]
        for arm, by_history in rates.items():
            for history in by_history:
                values = [s["decode_tokens_per_s"] for s in decode if s["arm"] == arm and s["history"] == history]
                by_history[history] = statistics.median(values)
        histories = sorted({s["history"] for s in decode})
        bare = {arm: rates[named(BARE[backend], weights_of[arm])] for arm in rates}  # of the arm's own weights
        part: dict[str, Any] = {
            "decode_tokens_per_s": {arm: {str(h): round(r, 1) for h, r in v.items()} for arm, v in rates.items()}
        }
        part["decode_ratio_to_bare"] = {
            arm: {str(h): round(v[h] / bare[arm][h], 3) for h in histories} for arm, v in rates.items()
        }
        daemons = [arm for arm in rates if arm.startswith("daemon:") and named("daemon:none", weights_of[arm]) in rates]
        part["daemon_ratio_to_none"] = {
            arm: {str(h): round(rates[arm][h] / rates[named("daemon:none", weights_of[arm])][h], 3) for h in histories}
            for arm in daemons
        }
        part["tokens_per_forward"] = {
            arm: {
                str(h): round(sum(len(s["tokens"]) for s in counted) / sum(s["forwards"] for s in counted), 3)
                for h in histories
                if (counted := [s for s in decode if s["arm"] == arm and s["history"] == h and s.get("forwards")])
            }
            for arm in daemons
        }
        part["per_token_time_longest_over_shortest"] = {
            arm: round(v[histories[0]] / v[histories[-1]], 3) for arm, v in rates.items()
        }
        choices = list(dict.fromkeys(s["weights"] for s in decode))
        agree = {weights: tokens_agree(decode, backend, weights) for weights in choices}
        part["tokens_agree"] = all(agree.values())
        part["repeats_agree"] = repeats_agree(decode)
        medians = {
            arm: statistics.median(s["prefill_s"] for s in prefill if s["arm"] == arm)
            for arm in dict.fromkeys(s["arm"] for s in prefill)
        }
        prefill_rates = {arm: args.prefill_tokens / s for arm, s in medians.items()}
        part["prefill_tokens_per_s"] = {arm: round(r, 1) for arm, r in prefill_rates.items()}
        part["prefill_ratio_to_one_forward"] = {
            arm: round(medians[named("one_forward", weights_of[arm])] / s, 3) for arm, s in medians.items()
        }
        part["weights"] = {
            weights: by_weights(weights, rates, prefill_rates, decode, histories, agree[weights]) for weights in choices
        }
        compile_s = {s["arm"]: s["compile_s"] for s in samples.get("compile", []) if s["backend"] == backend}
        if compile_s:
            part["compiled"] = {arm: by_compiled(arm, seconds, rates, decode) for arm, seconds in compile_s.items()}
        summary[backend] = part
    return summary


def by_compiled(
    arm: str, compile_s: float, rates: dict[str, dict[int, float]], decode: list[dict[str, Any]]
) -> dict[str, Any]:
    """A compiled arm against its scripted self (the same name without `+compiled`): the seconds compiling took,
    its decode rate over the scripted one's per history, and per history whether their greedy tokens are equal
    (and else how many they share before the first that differs)."""
    plain, weights = unnamed(arm)
    scripted = named(plain.removesuffix(COMPILED), weights)
    first = {(s["arm"], s["history"]): s["tokens"] for s in reversed(decode)}  # each arm's first repeat
    histories = sorted(rates[arm])
    shared = {h: shared_prefix(first[arm, h], first[scripted, h]) for h in histories}
    return {
        "scripted_arm": scripted,
        "compile_s": round(compile_s, 2),
        "decode_ratio_to_scripted": {str(h): round(rates[arm][h] / rates[scripted][h], 3) for h in histories},
        "tokens_equal": {str(h): first[arm, h] == first[scripted, h] for h in histories},
        "tokens_before_diverging": {str(h): shared[h] for h in histories},
    }


def by_weights(
    weights: str,
    rates: dict[str, dict[int, float]],
    prefill_rates: dict[str, float],
    decode: list[dict[str, Any]],
    histories: list[int],
    agree: bool,
) -> dict[str, Any]:
    """The daemon without a proposer at one weights choice: its decode and prefill tokens/s, their ratios to the
    float32 daemon's (when float32 was measured), whether its weights' arms agree, and how many decoded tokens it
    shares with the float32 daemon before the first that differs (information: other weights may decode others)."""
    daemon = named("daemon:none", weights)
    part: dict[str, Any] = {
        "daemon_decode_tokens_per_s": {str(h): round(rates[daemon][h], 1) for h in histories},
        "daemon_prefill_tokens_per_s": round(prefill_rates[daemon], 1),
        "tokens_agree": agree,
    }
    if "daemon:none" in rates:
        part["daemon_decode_ratio_to_float32"] = {
            str(h): round(rates[daemon][h] / rates["daemon:none"][h], 3) for h in histories
        }
        part["daemon_prefill_ratio_to_float32"] = round(prefill_rates[daemon] / prefill_rates["daemon:none"], 3)
        first = {(s["arm"], s["history"]): s["tokens"] for s in reversed(decode)}  # each arm's first repeat
        part["tokens_before_diverging_from_float32"] = {
            str(h): shared_prefix(first[daemon, h], first["daemon:none", h]) for h in histories
        }
    return part


def tokens_agree(decode: list[dict[str, Any]], backend: str, weights: str) -> bool:
    """Whether the greedy tokens of the daemons without a proposer (on every BLAS), the engine and the bare loop at
    one weights choice agree (compiled arms are compared with their scripted selves: `by_compiled`)."""
    compared = {named("engine", weights), named(BARE[backend], weights)}
    by_history: dict[int, set[tuple[int, ...]]] = {}
    for sample in decode:
        if sample["weights"] != weights or COMPILED in sample["arm"]:
            continue
        if sample["arm"] in compared or sample["arm"].startswith("daemon:none"):
            by_history.setdefault(sample["history"], set()).add(tuple(sample["tokens"]))
    return all(len(outputs) == 1 for outputs in by_history.values())


def repeats_agree(decode: list[dict[str, Any]]) -> bool:
    """Whether every arm decoded the same tokens at every repeat of a history (each starts from the same state)."""
    by_arm: dict[tuple[str, int], set[tuple[int, ...]]] = {}
    for sample in decode:
        by_arm.setdefault((sample["arm"], sample["history"]), set()).add(tuple(sample["tokens"]))
    return all(len(outputs) == 1 for outputs in by_arm.values())
