"""Rebuilding restored K/V once per generation or before every step: decode speed and memory, in process.

For every restoration plan (`--plans`: `recompute`, `model` for the model directory's plan, left out with a note
when the model ships none, or a manifest path; `model+kakeya_d4` or `PATH+kakeya_d4` is that plan with its kept
layers packed by the named KV compressor) and every rebuild mode of `--modes` (`generation`: rebuilt when a
generation starts, then extended as positions leave the window; `step`: rebuilt before every forward), a
`dlm_restore` session (`--sink` + `--window`) on the verifier (torch, CPU) is given `--prompt` tokens of held-out
text and generates `--new-tokens` greedy tokens, `--turns` times (each turn appends 16 more held-out tokens and
parks the session, as the daemon does between generations). Measured per run: decode tokens/s (generated tokens over
the wall time of the steps that generate), prefill seconds, sustained bytes of the parked session (resident K/V +
the plan's per-position state), and the per-step peak (sustained + the most restored K/V held at once). `full` runs
alongside as the baseline. Greedy tokens of the modes must agree; the script says so in `summary.modes_agree`.

Writes `results/bench_restore_rebuild_<stamp>.json` and a PNG (tokens/s and bytes per run).

Usage:
    python scripts/bench_restore_rebuild.py [--model NAME|DIR|GGUF] [--plans recompute,model] [--prompt 2048]
        [--new-tokens 32] [--turns 2] [--sink 4] [--window 256] [--modes generation,step]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.model_option import add_model_option
from lib.restoration import token_stream
from lib.results import RESULTS_DIR, write_results

from kv_cache_proposer.backends import load_verifier
from kv_cache_proposer.compression import KVCompressor, compressor_layer_store
from kv_cache_proposer.decoding import Decoder, GenerationBudget, SequenceState
from kv_cache_proposer.restoration import REBUILD_MODES, RestorationPlan, RestorationSetup, find_plan
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import DlmRestoreStrategy, FullStrategy


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(p, "the verifier")
    p.add_argument("--plans", default="recompute,model", help="comma-separated plans (default recompute,model)")
    p.add_argument("--prompt", type=int, default=2048, help="prompt tokens (default 2048)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per turn (default 32)")
    p.add_argument("--turns", type=int, default=2, help="generations per session (default 2)")
    p.add_argument("--sink", type=int, default=4, help="resident sink positions (default 4)")
    p.add_argument("--window", type=int, default=256, help="resident window positions (default 256)")
    p.add_argument("--seed", type=int, default=3, help="seed of the held-out text (default 3)")
    p.add_argument("--modes", default="generation,step", help="rebuild modes to run (default generation,step)")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where results go (default results/)")
    args = p.parse_args(argv)
    args.plans = [x.strip() for x in args.plans.split(",") if x.strip()]
    args.modes = [x.strip() for x in args.modes.split(",") if x.strip()]
    if not args.modes or any(mode not in REBUILD_MODES for mode in args.modes):
        p.error(f"--modes takes {', '.join(REBUILD_MODES)}")
    if args.prompt < 2 or args.new_tokens < 1 or args.turns < 1:
        p.error("--prompt must be >= 2, --new-tokens and --turns >= 1")
    if find_plan(args.model) is None:
        model_plans = [name for name in args.plans if name.partition("+")[0] == "model"]
        if model_plans:
            note = f"note: {args.model_name} ships no restoration plan: {', '.join(model_plans)} left out of --plans"
            print(note, file=sys.stderr)
            args.plans = [name for name in args.plans if name not in model_plans]
    return args


def resolve_plan(name: str, model: Path) -> RestorationPlan | None:
    if name == "recompute":
        return None
    base, _, compressor = name.partition("+")
    path = find_plan(model) if base == "model" else Path(base)
    if path is None:
        raise SystemExit(f"{model} ships no restoration plan")
    plan = RestorationPlan.load(path)
    return plan.with_kept_compressor(compressor) if compressor else plan


def setup_for(plan: RestorationPlan | None, rebuild: str) -> RestorationSetup:
    """The setup the daemon builds for `plan`: its kept layers through the plan's compressor, if it names one."""
    kept = KVCompressor.parse(plan.kept_compressor) if plan is not None else KVCompressor()
    return RestorationSetup(plan, rebuild=rebuild, kept_store=compressor_layer_store("torch", kept))  # type: ignore[arg-type]


def run_session(verifier: Any, cache: Any, texts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Turns of (append, generate, park); returns the tokens, timings and bytes."""
    decoder = Decoder(verifier, prefill_chunk_tokens=512)
    seq = SequenceState(cache=cache, tokens=[])
    generated_all: list[int] = []
    decode_s = prefill_s = 0.0
    sustained = []
    for text in texts:
        seq.tokens.extend(text)
        budget = GenerationBudget(max_new_tokens=new_tokens)
        generated: list[int] = []
        while len(generated) < new_tokens:
            started = time.perf_counter()
            step = decoder.step(seq, SamplingParams(), budget, len(generated))
            elapsed = time.perf_counter() - started
            if step.tokens and generated:
                decode_s += elapsed
            else:
                prefill_s += elapsed  # prefill chunks and the step that finishes the prompt
            generated += step.tokens
        generated_all += generated
        cache.park()
        sustained.append(int(cache.nbytes))
    decoded = len(generated_all) - len(texts)
    return {
        "tokens": generated_all,
        "decode_tokens_per_s": decoded / decode_s if decode_s else 0.0,
        "prefill_s": prefill_s,
        "sustained_bytes": sustained[-1],
        "peak_bytes": max(sustained) + int(cache.footprint().peak_restored_bytes),
        "restoration_state_bytes": int(cache.footprint().restoration_state_bytes),
        "evicted_tokens": int(cache.evicted_count),
    }


def plot(samples: list[dict[str, Any]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s["run"] for s in samples]
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(6 + 1.2 * len(names), 4))
    speed.bar(names, [s["decode_tokens_per_s"] for s in samples], color="tab:blue")
    speed.set(ylabel="decode tokens/s", title="decode speed")
    width = 0.4
    xs = range(len(names))
    memory.bar([x - width / 2 for x in xs], [s["sustained_bytes"] / 1024 for s in samples], width, label="sustained")
    memory.bar([x + width / 2 for x in xs], [s["peak_bytes"] / 1024 for s in samples], width, label="per-step peak")
    memory.set_xticks(list(xs), names)
    memory.set(ylabel="KiB", title="session bytes")
    memory.legend()
    for axis in (speed, memory):
        axis.tick_params(axis="x", rotation=30)
    fig.savefig(png, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    verifier = load_verifier("torch", args.model, device="cpu", dtype="float32")
    rng = random.Random(args.seed)
    prompt = token_stream(tokenizer, 1, args.prompt, rng, held_out=True)[0]
    texts = [prompt, *token_stream(tokenizer, args.turns - 1, 16, rng, held_out=True)]
    strategy = DlmRestoreStrategy(sink=args.sink, window=args.window)
    samples = [{"run": "full", **run_session(verifier, verifier.new_cache(FullStrategy()), texts, args.new_tokens)}]
    agree = True
    for name in args.plans:
        plan = resolve_plan(name, args.model)
        tokens = {}
        for rebuild in args.modes:
            cache = verifier.new_cache(strategy, restoration=setup_for(plan, rebuild))
            result = run_session(verifier, cache, texts, args.new_tokens)
            tokens[rebuild] = result["tokens"]
            samples.append({"run": f"{Path(name).stem}/{rebuild}", "plan": name, "rebuild": rebuild, **result})
            print(f"{name} {rebuild}: {result['decode_tokens_per_s']:.1f} tok/s", file=sys.stderr)
        agree = agree and all(run == tokens[args.modes[0]] for run in tokens.values())
    summary = {
        "runs": {
            s["run"]: {k: s[k] for k in ("decode_tokens_per_s", "prefill_s", "sustained_bytes", "peak_bytes")}
            for s in samples
        },
        "modes_agree": agree,
        "matches_full": {s["run"]: s["tokens"] == samples[0]["tokens"] for s in samples[1:]},
    }
    path = write_results(
        "bench_restore_rebuild",
        config=vars(args),
        samples=samples,
        summary=summary,
        plot=lambda png: plot(samples, png),
        out_dir=args.results_dir,
    )
    runs: dict[str, dict[str, Any]] = summary["runs"]  # type: ignore[assignment]
    for run, values in runs.items():
        speed, sustained, peak = values["decode_tokens_per_s"], values["sustained_bytes"], values["peak_bytes"]
        print(f"{run}: {speed:.1f} tok/s, sustained {sustained} B, per-step peak {peak} B")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
