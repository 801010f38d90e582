"""Speculative decoding side by side: tokens/s, verifier forwards per token and acceptance of each proposer.

Every proposer decodes the same prompts greedily with the same verifier, in one run, round-robin per prompt and
repeat so machine noise hits all of them alike. Greedy outputs must be identical to `none`; the summary states
each proposer's speedup over `none` (a ratio of tokens/s), whatever it is.

Prompts are slices of a local text corpus tokenized with the verifier's tokenizer (default: the held-out files of
the standard-library corpus `scripts/train_tiny.py` trains on, text kakeya-tiny never saw), or of a `.npy`
token-id file.

Each speculative proposer runs under every `--draft-policies` entry (`full`: every proposal a whole block;
`adaptive`: the draft length shrinks after rejections and grows after full acceptances; `cost`: each step drafts
the length its session's cost model expects fastest, or nothing), as arms `NAME` (full), `NAME/adaptive` and
`NAME/cost`.

The dflash arm uses `--dflash`, else the model directory's own `dflash/` drafter when it has one; without either it
is left out, with a note. The draft_model arm uses `--draft-model`, else (with `--draft-layers N`) the verifier cut
to its first N decoder layers, which keeps its embeddings, final norm and LM head: a smaller AR model with the same
vocabulary, written to a temporary directory.

With `--histories` the proposers run through the daemon instead, one daemon per `--arms` entry, on held-out
prompts of each history length (chat-formatted in the model's own template by default): decode tokens/s, tokens
per verifier forward and the ratio to `none` per history (lib/speculative_daemon.py says how).

Usage:
    python scripts/bench_speculative.py [--model NAME|DIR|GGUF] [--dflash DRAFTER_DIR]
        [--draft-model DIR | --draft-layers N] [--corpus FILE] [--prompts 8] [--prompt-tokens 128]
        [--max-tokens 128] [--repeats 2] [--draft-policies full adaptive] [--results-dir DIR]
    python scripts/bench_speculative.py --histories 128,1024,4096,8192 [--model NAME|DIR|GGUF]
        [--dflash DRAFTER_DIR] [--arms none,ngram/full,ngram/cost,dflash/full,dflash/cost] [--prompt-form chat|source]
        [--prompts 4] [--max-tokens 128] [--repeats 1] [--rounds 1] [--daemon-flags "--weights float32"]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib import speculative_daemon
from lib.corpus import STDLIB, read_text, split_sources, stdlib_sources
from lib.model_option import add_model_option
from lib.results import RESULTS_DIR, write_results
from lib.tokens import read_tokens, spread_windows

from inference_engine.model_dir_info import model_drafter
from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from kv_cache_proposer.decoding import Decoder, GenerationBudget, SequenceState
from kv_cache_proposer.proposers import ProposerOptions, load_proposer
from kv_cache_proposer.proposers.base import DraftPolicy, Proposer
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import FullStrategy


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(p, "the verifier")
    p.add_argument("--dflash", type=Path, help="DFlash drafter directory (adds the dflash arm)")
    p.add_argument("--draft-model", type=Path, help="smaller checkpoint (adds the draft_model arm)")
    p.add_argument(
        "--draft-layers",
        type=int,
        default=0,
        help="without --draft-model: add a draft_model arm that is the verifier cut to its first N layers",
    )
    p.add_argument("--corpus", type=Path, help="text file or .npy token ids (default: held-out standard library)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--num-draft-tokens", type=int, default=0, help="0: each proposer's default")
    p.add_argument(
        "--draft-policies",
        nargs="+",
        choices=[policy.value for policy in DraftPolicy],
        default=[policy.value for policy in DraftPolicy],
        help="draft-length policies each speculative proposer runs under",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    daemon = p.add_argument_group("through the daemon (--histories)")
    daemon.add_argument(
        "--histories", default="", help="history lengths in tokens, comma-separated: run every arm through a daemon"
    )
    daemon.add_argument(
        "--arms",
        default="",
        help="daemon arms, comma-separated: none, ngram, dflash, draft_model, each optionally /full, /adaptive or "
        "/cost for its --draft-policy (alone: the proposer's auto policy; default: none,ngram/full,ngram/cost, and "
        "dflash/full,dflash/cost with a drafter)",
    )
    daemon.add_argument(
        "--prompt-form",
        choices=("chat", "source"),
        default="chat",
        help="chat: held-out chat prompts in the model's template; source: held-out source windows",
    )
    daemon.add_argument("--daemon-flags", default="", help="more flags for every daemon (the defaults otherwise)")
    daemon.add_argument("--seed", type=int, default=0, help="seeds the chat prompts")
    daemon.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the bench this many times, each in fresh daemons, to show the spread from one daemon process to "
        "another (each row gives every round's ratio to none)",
    )
    args = p.parse_args(argv)
    args.histories = [int(h) for h in args.histories.split(",") if h]
    if any(h < 1 for h in args.histories):
        p.error("--histories must hold lengths >= 1")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    return args


def load_prompts(args: argparse.Namespace) -> tuple[list[list[int]], list[str]]:
    """The prompts, and the files they were cut from."""
    if args.corpus is not None:
        ids, files = read_tokens(args.corpus, args.model), [str(args.corpus)]
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
        held_out = split_sources(stdlib_sources())[1]
        ids = np.asarray(tokenizer.encode("".join(read_text(f) for f in held_out)), dtype=np.int64)
        files = [str(f.relative_to(STDLIB)) for f in held_out]
    if len(ids) < args.prompt_tokens:
        raise SystemExit(f"the corpus holds {len(ids)} tokens, fewer than --prompt-tokens {args.prompt_tokens}")
    return spread_windows(ids, args.prompts, args.prompt_tokens), files


def truncated_copy(model_dir: Path, layers: int, out: Path) -> Path:
    """The checkpoint in `model_dir` cut to its first `layers` decoder layers, saved to `out`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    config = model.config
    if not 1 <= layers < config.num_hidden_layers:
        raise SystemExit(f"--draft-layers must be in 1..{config.num_hidden_layers - 1}, got {layers}")
    model.model.layers = model.model.layers[:layers]
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    model.save_pretrained(out)
    return out


class Clock:
    """Seconds spent in the timed calls (after the device finished them)."""

    def __init__(self, device: torch.device) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._cuda = device.type == "cuda"

    def time(self, call: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        out = call(*args, **kwargs)
        if self._cuda:
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - started
        self.calls += 1
        return out


class TimedVerifier:
    """The verifier with its `verify` calls timed."""

    def __init__(self, verifier: TorchVerifier, clock: Clock) -> None:
        self._verifier, self._clock = verifier, clock

    def verify(self, *args: Any, **kwargs: Any) -> Any:
        return self._clock.time(self._verifier.verify, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._verifier, name)


class TimedDraft:
    """A draft session with its `propose` calls timed."""

    def __init__(self, session: Any, clock: Clock) -> None:
        self._session, self._clock = session, clock

    def propose(self, history: Any, max_tokens: int) -> list[int]:
        return self._clock.time(self._session.propose, history, max_tokens)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)


def decode(
    verifier: TorchVerifier,
    proposer: Proposer,
    prompt: list[int],
    max_tokens: int,
    policy: DraftPolicy = DraftPolicy.FULL,
) -> dict[str, Any]:
    """Greedy decoding of `max_tokens` tokens after `prompt`; the clock covers prefill and decode."""
    verify_clock, draft_clock = Clock(verifier.device), Clock(verifier.device)
    # one verify forward per step in every arm (a speculative step never bursts; `none` is made not to either)
    decoder = Decoder(cast(Any, TimedVerifier(verifier, verify_clock)), draft_policy=policy, burst_tokens=1)
    strategy = FullStrategy()
    draft = TimedDraft(proposer.open(strategy), draft_clock)
    seq = SequenceState(cache=verifier.new_cache(strategy), tokens=list(prompt), draft_session=cast(Any, draft))
    budget = GenerationBudget(max_new_tokens=max_tokens)
    tokens: list[int] = []
    forwards = drafted = accepted = drafting_steps = drafting_tokens = 0
    started = time.perf_counter()
    while True:
        step = decoder.step(seq, SamplingParams(), budget, len(tokens))
        tokens += step.tokens
        forwards += step.forwards
        drafted += step.drafted
        accepted += step.accepted
        if step.drafted:
            drafting_steps += 1
            drafting_tokens += len(step.tokens)
        if step.stop is not None:
            break
    seconds = time.perf_counter() - started
    seq.cache.release()
    seq.draft_session.release()
    return {
        "tokens": tokens,
        "seconds": seconds,
        "verifier_forwards": forwards,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "drafting_steps": drafting_steps,
        "verify_seconds": verify_clock.seconds,
        "verify_calls": verify_clock.calls,
        "propose_seconds": draft_clock.seconds,
        "propose_calls": draft_clock.calls,
        "drafting_step_tokens": drafting_tokens,
    }


def summarize(runs: list[dict[str, Any]], baseline: dict[str, Any] | None) -> dict[str, Any]:
    generated = sum(len(r["tokens"]) for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    steps = sum(r["drafting_steps"] for r in runs)
    out = {
        "tokens_per_s": generated / seconds,
        "median_run_tokens_per_s": statistics.median(len(r["tokens"]) / r["seconds"] for r in runs),
        "verifier_forwards_per_token": sum(r["verifier_forwards"] for r in runs) / generated,
        "draft_acceptance_rate": (
            sum(r["accepted_tokens"] for r in runs) / max(1, sum(r["draft_tokens"] for r in runs))
        ),
        "mean_acceptance_length": sum(r["drafting_step_tokens"] for r in runs) / steps if steps else 1.0,
        "verify_ms": 1000 * sum(r["verify_seconds"] for r in runs) / sum(r["verify_calls"] for r in runs),
    }
    proposals = sum(r["propose_calls"] for r in runs)
    if proposals and steps:
        out["propose_ms"] = 1000 * sum(r["propose_seconds"] for r in runs) / proposals
        out["propose_cost_vs_verify"] = out["propose_ms"] / out["verify_ms"]
    if baseline is not None:
        out["speedup_vs_none"] = out["tokens_per_s"] / baseline["tokens_per_s"]
    return out


def plot(summary: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary["proposers"])
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    for ax, key, label in zip(
        axes,
        ("tokens_per_s", "verifier_forwards_per_token", "mean_acceptance_length"),
        ("tokens / s", "verifier forwards / token", "tokens per drafting step"),
        strict=True,
    ):
        ax.bar(names, [summary["proposers"][n][key] for n in names], color="tab:blue")
        ax.set_title(label)
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle("speculative decoding, greedy, same prompts")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def through_daemon(args: argparse.Namespace) -> int:
    if args.dflash is None:
        args.dflash = model_drafter(args.model)
    default = "none,ngram/full,ngram/cost" + (",dflash/full,dflash/cost" if args.dflash is not None else "")
    try:
        args.arms = speculative_daemon.parse_arms(args.arms or default)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if any(a.startswith("dflash") for a in args.arms) and args.dflash is None:
        raise SystemExit(f"{args.model_name} ships no DFlash drafter (dflash/): name one with --dflash")
    if any(a.startswith("draft_model") for a in args.arms) and args.draft_model is None:
        raise SystemExit("a draft_model arm needs --draft-model")
    path = speculative_daemon.run(args)
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.histories:
        return through_daemon(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    verifier = TorchVerifier.load(args.model, device=args.device, dtype=args.dtype)
    scratch = tempfile.TemporaryDirectory(prefix="bench-speculative-")
    if args.draft_model is None and args.draft_layers:
        args.draft_model = truncated_copy(args.model, args.draft_layers, Path(scratch.name) / "draft")
    if args.dflash is None:
        args.dflash = model_drafter(args.model)
        if args.dflash is None:
            print(
                f"note: {args.model_name} ships no DFlash drafter (dflash/) and no --dflash: no dflash arm",
                file=sys.stderr,
            )
    arms: dict[str, ProposerOptions] = {"none": ProposerOptions(), "ngram": ProposerOptions(name="ngram")}
    if args.draft_model:
        arms["draft_model"] = ProposerOptions(name="draft_model", draft_model=args.draft_model)
    if args.dflash:
        arms["dflash"] = ProposerOptions(name="dflash", draft_model=args.dflash)
    if args.num_draft_tokens:
        arms = {
            name: ProposerOptions(name=o.name, draft_model=o.draft_model, num_draft_tokens=args.num_draft_tokens)
            if name != "none"
            else o
            for name, o in arms.items()
        }
    loaded = {name: load_proposer(options, verifier, backend="torch") for name, options in arms.items()}
    policies = [DraftPolicy(p) for p in args.draft_policies]
    proposers: dict[str, tuple[Proposer, DraftPolicy]] = {"none": (loaded.pop("none"), DraftPolicy.FULL)}
    for name, proposer in loaded.items():
        for policy in policies:
            proposers[name if policy is DraftPolicy.FULL else f"{name}/{policy.value}"] = (proposer, policy)
    prompts, prompt_files = load_prompts(args)
    for proposer, policy in proposers.values():  # warm-up: first forwards allocate and load kernels
        decode(verifier, proposer, prompts[0], 4, policy)

    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in proposers}
    for repeat in range(args.repeats):
        for index, prompt in enumerate(prompts):
            order = list(proposers) if (repeat + index) % 2 == 0 else list(reversed(proposers))
            for name in order:
                proposer, policy = proposers[name]
                run = decode(verifier, proposer, prompt, args.max_tokens, policy)
                runs[name].append({"prompt": index, "repeat": repeat, **run})

    baseline = summarize(runs["none"], None)
    summary: dict[str, Any] = {"proposers": {}}
    for name, arm_runs in runs.items():
        summary["proposers"][name] = summarize(arm_runs, None if name == "none" else baseline)
        reference = [r["tokens"] for r in runs["none"]]
        summary["proposers"][name]["identical_to_none"] = [r["tokens"] for r in arm_runs] == reference
    summary["speedup_vs_none"] = {
        name: round(s.get("speedup_vs_none", 1.0), 3) for name, s in summary["proposers"].items()
    }
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    config["verifier"] = verifier.description
    config["prompt_files"] = prompt_files
    samples = {
        name: [{k: v for k, v in r.items() if k != "tokens"} for r in arm_runs] for name, arm_runs in runs.items()
    }
    path = write_results(
        "bench_speculative",
        config=config,
        samples=samples,
        summary=summary,
        plot=lambda png: plot(summary, png),
        out_dir=args.results_dir,
    )
    for name, values in summary["proposers"].items():
        print(
            f"{name:12s} {values['tokens_per_s']:8.1f} tok/s  {values['verifier_forwards_per_token']:.3f} fwd/tok  "
            f"accept len {values['mean_acceptance_length']:.2f}  speedup {summary['speedup_vs_none'][name]:.2f}x  "
            f"identical={values['identical_to_none']}"
            + (f"  propose/verify {values['propose_cost_vs_verify']:.2f}" if "propose_cost_vs_verify" in values else "")
        )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
