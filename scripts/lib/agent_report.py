"""The agent bench's summary, gates and plot, from its per-turn samples and per-run records (plain dicts).

A sample is one turn of one arm: `latency_s`, `processed_tokens` (prompt tokens the server ran through the model),
`new_tokens` (what a server that keeps the conversation has to run), `output_tokens`, `after_restart` (the agent's
first turn after the restart). A run is one arm on one workload and template: `wall_s` is the sum of its turns'
latencies; `restart` says what the restart did and took.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

OURS = "ours"
PEERS = ("llama", "mlx")
ARM_STYLES = {
    "ours": ("tab:blue", "ours (SDK, AppendOnlyChat deltas)"),
    "shim": ("tab:purple", "ours, HTTP shim (openai client)"),
    "llama": ("tab:red", "llama-server (GGUF)"),
    "mlx": ("tab:orange", "mlx_lm.server (MLX copy)"),
}
MAX_WALL_RATIO = 0.5


def run_rows(samples: list[dict[str, Any]], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per finished run: its totals over turns."""
    rows = []
    for run in runs:
        if run.get("skipped") or run.get("error"):
            rows.append(dict(run))
            continue
        turns = [s for s in samples if _key(s) == _key(run)]
        processed = sum(s["processed_tokens"] for s in turns)
        new = sum(s["new_tokens"] for s in turns)
        rows.append(
            {
                **run,
                "turns": len(turns),
                "latency_s_mean": run["wall_s"] / len(turns) if turns else None,
                "processed_tokens": processed,
                "new_tokens": new,
                "output_tokens": sum(s["output_tokens"] for s in turns),
                "processed_over_new": processed / new if new else None,
            }
        )
    return rows


def summarize(samples: list[dict[str, Any]], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals per run, our wall time over each other arm's per workload and template, and the gates."""
    rows = run_rows(samples, runs)
    walls = {_key(r): r["wall_s"] for r in rows if r.get("wall_s") is not None and not r.get("error")}
    ratios: dict[str, dict[str, float]] = defaultdict(dict)
    for (arm, workload, template), wall in walls.items():
        ours = walls.get((OURS, workload, template))
        if arm != OURS and ours is not None and wall > 0:
            ratios[f"{workload}/{template}"][arm] = ours / wall
    return {"runs": rows, "ours_wall_over": dict(ratios), "gates": gates(samples, rows, dict(ratios))}


def gates(samples: list[dict[str, Any]], rows: list[dict[str, Any]], ratios: dict[str, dict[str, float]]) -> dict:
    """The bench's gates; a gate with nothing measured is None."""
    multi = {f"{r['workload']}/{r['template']}" for r in rows if r.get("agents", 1) > 1}
    wall_ratios = {f"{k}/{peer}": v for k, by_arm in ratios.items() if k in multi for peer, v in by_arm.items()}
    wall_ratios = {k: v for k, v in wall_ratios.items() if k.rsplit("/", 1)[1] in PEERS}
    ours = [s for s in samples if s["arm"] == OURS]
    steady = [s for s in ours if not s["after_restart"]]
    restarted = [s for s in ours if s["after_restart"]]
    # A turn may process fewer tokens than it added (a prefix copied from another session); never more.
    mismatched = [s for s in steady if s["processed_tokens"] > s["new_tokens"]]
    single = {
        peer: by_arm[peer]
        for key, by_arm in ratios.items()
        if key.endswith("/append_only") and key not in multi
        for peer in by_arm
    }
    return {
        "multi_agent_ours_wall_at_most_half_of_each_peer": {
            "ratios": wall_ratios,
            "pass": all(v <= MAX_WALL_RATIO for v in wall_ratios.values()) if wall_ratios else None,
        },
        "ours_processes_only_each_turns_new_tokens": {
            "turns": len(steady),
            "turns_processing_more": len(mismatched),
            "extra_tokens": sum(s["processed_tokens"] - s["new_tokens"] for s in mismatched),
            "tokens_not_processed": sum(max(0, s["new_tokens"] - s["processed_tokens"]) for s in steady),
            "pass": not mismatched if steady else None,
        },
        "ours_after_restart_processes_nothing_again": {
            "turns": len(restarted),
            "reprocessed_tokens": [max(0, s["processed_tokens"] - s["new_tokens"]) for s in restarted],
            "pass": all(s["processed_tokens"] <= s["new_tokens"] for s in restarted) if restarted else None,
        },
        "one_agent_append_only_ours_wall_over_peer": single,
    }


def plot(samples: list[dict[str, Any]], runs: list[dict[str, Any]], path: Path) -> None:
    """Per workload and template: turn latency, and prompt tokens processed against the turn's new tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(s["workload"], s["template"]) for s in samples})
    if not panels:
        return
    fig, axes = plt.subplots(len(panels), 2, figsize=(13, 3.4 * len(panels)), squeeze=False)
    for (workload, template), (left, right) in zip(panels, axes, strict=True):
        turns = [s for s in samples if s["workload"] == workload and s["template"] == template]
        for arm, (color, label) in ARM_STYLES.items():
            rows = sorted((s for s in turns if s["arm"] == arm), key=lambda s: s["step"])
            if not rows:
                continue
            run = next((r for r in runs if _key(r) == (arm, workload, template)), {})
            wall = run.get("wall_s")
            text = f"{label}, {wall:.0f} s" if wall is not None else label
            steps = [s["step"] for s in rows]
            left.plot(steps, [s["latency_s"] for s in rows], ".-", ms=3, lw=0.8, color=color, label=text)
            right.plot(steps, [max(1, s["processed_tokens"]) for s in rows], ".-", ms=3, lw=0.8, color=color)
            if arm == OURS or not any(s["arm"] == OURS for s in turns):
                right.plot(steps, [max(1, s["new_tokens"]) for s in rows], "--", lw=0.8, color="black")
        restarts = {s["step"] for s in turns if s["after_restart"]}
        for axis in (left, right):
            if restarts:
                axis.axvline(min(restarts) - 0.5, color="gray", ls=":", lw=1)
            axis.set_yscale("log")
            axis.set_xlabel("turn (all agents, in order)")
        left.set_ylabel("turn latency (s)")
        left.set_title(f"{workload}, {template} template")
        left.legend(fontsize="x-small", loc="upper left")
        right.set_ylabel("prompt tokens processed")
        right.set_title("processed per turn (dashed: the turn's new tokens; dotted: restart)", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _key(row: dict[str, Any]) -> tuple[str, str, str]:
    return row["arm"], row["workload"], row["template"]
