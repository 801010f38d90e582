"""Agent sessions against the servers users run, on the same model: our daemon, its HTTP shim, llama.cpp's
llama-server and mlx_lm.server, each driven turn by turn through the same seeded agent transcripts.

Workloads (`--workloads AGENTSxTURNS,...`): one agent for 60 turns, and 8 agents interleaved round-robin (one
request at a time) for 30 turns each; each with both chat templates the bench ships (`--templates`): SmolLM2's
append-only ChatML, and a variant that drops earlier turns' reasoning when it re-renders (agent_transcripts.py).

Arms (`--arms`), all greedy with end-of-sequence banned where the server allows it, every server given `--threads`:
- ours: the daemon through the Python SDK, one session per conversation, only `AppendOnlyChat` deltas appended;
  processed tokens = the generation's prefill tokens;
- shim: the daemon's deprecated HTTP shim through the official `openai` client, the whole message list every
  request; processed = `usage.prompt_tokens` (every request is a single-shot session);
- llama: llama-server on the model's GGUF file, slots and prompt cache set up for several clients;
  processed = `timings.prompt_n` of its responses;
- mlx: mlx_lm.server on an MLX copy of the model (float32), its prompt cache on;
  processed = `usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens`.
A peer that is not installed is skipped with a message (scripts/bench_agentic/install_peers.sh installs them).

Halfway through each run (`--restart-at`), the server restarts: ours is killed with SIGKILL and started again on
the same `--state-dir`; llama-server saves its slots through its /slots API, is killed, starts and restores them;
mlx_lm.server and the shim are killed and started again.

Per turn: latency (the turn's requests, client side), prompt tokens the server processed, the turn's new tokens
(what a server that keeps the conversation has to process), output tokens. Per run: wall time (the sum of its turns'
latencies) and the restart. Summary: totals, our wall time over each arm's, and the gates (lib/agent_report.py).
Writes results/bench_vs_peers_<stamp>.json as it goes (a killed run keeps what it measured) and, at the end, a PNG
of per-turn latency and processed tokens per arm, workload and template.

Usage:
    python scripts/bench_agentic/bench_vs_peers.py --model smollm2-135m-instruct [--arms ours,shim,llama,mlx]
        [--workloads 1x60,8x30] [--templates append_only,drop_reasoning] [--threads 1] [--restart-at 0.5]
        [--reasoning-tokens 100-1000] [--tool-result-tokens 200-2000] [--answer-tokens 50-300]
        [--tool-calls-per-task 1-4] [--max-history-tokens 7680] [--seed 0] [--gguf FILE] [--weights auto]
        [--daemon-args "..."] [--llama-slots 4] [--llama-cache-ram-mib 8192] [--llama-cache-reuse 256]
        [--llama-args "..."] [--mlx-prompt-cache-size 10] [--mlx-bits 0] [--mlx-blas auto] [--out results]
        [--quiet]
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agent_transcripts import (
    TEMPLATES,
    TEMPLATES_DIR,
    THINK_CLOSE,
    THINK_OPEN,
    ToolCorpus,
    TranscriptPlanner,
    Turn,
    add_transcript_options,
    load_template,
    round_robin,
    transcript_config,
)
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lib import agent_report
from lib.agent_arms import Arm, Conversation, DaemonArm, RequestStats
from lib.chat_arms import ChatArm, LlamaDialect, MlxDialect, ShimDialect
from lib.mlx_copy import convert_to_mlx
from lib.model_option import add_model_option
from lib.peer_servers import LLAMA_SERVER, DaemonProcess, llama_server, missing_peer, mlx_server
from lib.results import new_stamp, write_results

ROOT = Path(__file__).resolve().parents[2]
NAME = "bench_vs_peers"
ARMS = ("ours", "shim", "llama", "mlx")
WRITE_EVERY_S = 30.0
# Room in each llama-server slot beyond the planned history, which the transcripts estimate.
HISTORY_MARGIN_TOKENS = 512


@dataclass(slots=True)
class TurnSample:
    """One turn of one arm (`step` counts the turns of all agents in the order they ran)."""

    arm: str
    workload: str
    template: str
    step: int
    agent: int
    turn: int
    new_conversation: bool
    after_restart: bool
    requests: int
    latency_s: float
    prompt_tokens: int
    processed_tokens: int
    new_tokens: int
    output_tokens: int


class Bench:
    """Runs arms over workloads and templates, and writes what it measured as it goes."""

    def __init__(self, args: argparse.Namespace, tokenizer: Any, workdir: Path) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self.workdir = workdir
        self.samples: list[TurnSample] = []
        self.runs: list[dict[str, Any]] = []
        self.stamp = new_stamp()
        self._written_at = 0.0
        self._mlx_dir: Path | None = None

    def run(self) -> Path:
        planner = TranscriptPlanner(transcript_config(self.args), ToolCorpus(self.tokenizer))
        for workload in self.args.workloads:
            agents, turns = workload
            schedule = round_robin(planner.plan(agents, turns))
            for template in self.args.templates:
                for name in self.args.arms:
                    self.run_arm(name, f"{agents}x{turns}", agents, template, schedule)
        return self.write(final=True)

    def run_arm(self, name: str, workload: str, agents: int, template: str, schedule: list[Turn]) -> None:
        run: dict[str, Any] = {"arm": name, "workload": workload, "agents": agents, "template": template}
        self.runs.append(run)
        if reason := self.skip_reason(name):
            print(f"skipping {name}: {reason}", file=sys.stderr)
            run["skipped"] = reason
            self.write()
            return
        arm = self.make_arm(name, template)
        restart_step = int(len(schedule) * self.args.restart_at) if self.args.restart_at > 0 else -1
        conversations: dict[int, Conversation] = {}
        waiting: set[int] = set()
        run["wall_s"] = 0.0
        started = time.perf_counter()
        try:
            arm.start()
            run["command"] = arm.command()
            label = f"{name} {workload} {template}"
            for step, turn in enumerate(tqdm(schedule, desc=label, unit="turn", disable=self.args.quiet)):
                if step == restart_step:
                    run["restart"] = arm.restart()
                    waiting = {t.agent for t in schedule[step:]}
                if turn.new_conversation:
                    if turn.agent in conversations:
                        conversations[turn.agent].close()
                    conversations[turn.agent] = arm.conversation(f"agent-{turn.agent}")
                stats = play(conversations[turn.agent], turn)
                sample = _sample(name, workload, template, step, turn, turn.agent in waiting, stats)
                waiting.discard(turn.agent)
                self.samples.append(sample)
                run["wall_s"] += sample.latency_s
                self.write()
        except Exception as exc:  # a failed arm keeps what it measured; the other arms still run
            run["error"] = f"{type(exc).__name__}: {exc}"
            print(f"{name} {workload} {template} failed: {run['error']}", file=sys.stderr)
        finally:
            run["run_s"] = time.perf_counter() - started
            arm.stop()
        self.write(force=True)

    def skip_reason(self, name: str) -> str | None:
        if name in ("llama", "mlx") and (missing := missing_peer(name)):
            return missing
        if name == "llama" and self.args.gguf is None:
            return "llama-server needs a GGUF file of the model (--gguf); this model was not converted from one"
        return None

    def make_arm(self, name: str, template: str) -> Arm:
        args, text = self.args, load_template(template)
        path = TEMPLATES_DIR / TEMPLATES[template]
        banned = tuple(sorted(set(self.tokenizer.all_special_ids)))
        if name == "ours":
            state = Path(tempfile.mkdtemp(prefix="state-", dir=self.workdir))
            return DaemonArm(name, self.daemon_flags(args.model), self.tokenizer, text, state)
        if name == "shim":
            shim = DaemonProcess([*self.daemon_flags(self.template_view(template)), "--http-port", "0"])
            return ChatArm(name, shim, ShimDialect(), self.tokenizer, text, THINK_OPEN)
        if name == "llama":
            slots = Path(tempfile.mkdtemp(prefix="slots-", dir=self.workdir))
            context = args.llama_context_tokens or args.llama_slots * (args.max_history_tokens + HISTORY_MARGIN_TOKENS)
            server = llama_server(
                args.gguf,
                path,
                threads=args.threads,
                slots=args.llama_slots,
                context_tokens=context,
                cache_ram_mib=args.llama_cache_ram_mib,
                cache_reuse_tokens=args.llama_cache_reuse,
                slot_dir=slots,
                extra=shlex.split(args.llama_args),
            )
            return ChatArm(name, server, LlamaDialect(banned), self.tokenizer, text, THINK_OPEN)
        server = mlx_server(
            self.mlx_dir(), path, threads=args.threads, prompt_cache_size=args.mlx_prompt_cache_size, blas=args.mlx_blas
        )
        return ChatArm(name, server, MlxDialect(banned), self.tokenizer, text, THINK_OPEN, model_id="default_model")

    def daemon_flags(self, model_dir: Path) -> list[str]:
        flags = ["--model", str(model_dir), "--threads", str(self.args.threads), "--weights", self.args.weights]
        return [*flags, *shlex.split(self.args.daemon_args)]

    def template_view(self, template: str) -> Path:
        """The model directory with `template` as its chat template (its other files linked), for the shim."""
        view = self.workdir / f"view-{template}" / Path(self.args.model).name
        if not view.exists():
            view.mkdir(parents=True)
            for entry in Path(self.args.model).iterdir():
                if entry.name != "chat_template.jinja":
                    (view / entry.name).symlink_to(entry.resolve())
            (view / "chat_template.jinja").write_text(load_template(template))
        return view

    def mlx_dir(self) -> Path:
        """The model converted once to an mlx-lm directory for mlx_lm.server: float32, or quantized by mlx-lm to
        `--mlx-bits` in groups of 32 (4 bits: the layout of a GGUF Q4_1 block)."""
        if self._mlx_dir is None:
            target = convert_to_mlx(Path(self.args.model), self.workdir / "mlx", quiet=True)
            if self.args.mlx_bits:
                quantized = self.workdir / f"mlx-q{self.args.mlx_bits}"
                bits = ("-q", "--q-bits", str(self.args.mlx_bits), "--q-group-size", "32")
                command = [sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(target), "--mlx-path"]
                subprocess.run([*command, str(quantized), *bits], check=True, stdout=subprocess.DEVNULL)
                target = quantized
            self._mlx_dir = target
        return self._mlx_dir

    def write(self, *, force: bool = False, final: bool = False) -> Path:
        """Write the results so far (at most every WRITE_EVERY_S unless forced); the PNG only when final."""
        path = self.args.out / f"{NAME}_{self.stamp}.json"
        if not (force or final) and time.monotonic() - self._written_at < WRITE_EVERY_S:
            return path
        self._written_at = time.monotonic()
        samples = [asdict(s) for s in self.samples]
        summary = agent_report.summarize(samples, self.runs)
        return write_results(
            NAME,
            config={**vars(self.args), "complete": final},
            samples=samples,
            summary=summary,
            plot=(lambda png: agent_report.plot(samples, self.runs, png)) if final else None,
            out_dir=self.args.out,
            environment_extra=_versions(),
            stamp=self.stamp,
        )


def play(conversation: Conversation, turn: Turn) -> list[RequestStats]:
    """One turn: the reasoning, then the written tool call, or the generated final answer."""
    stats = [conversation.reply(turn.messages, turn.reasoning_tokens)]
    if turn.tool_call is not None:
        conversation.end_reply(THINK_CLOSE + turn.tool_call)
    else:
        stats.append(conversation.continue_reply(THINK_CLOSE, turn.answer_tokens))
        conversation.end_reply("")
    return stats


def _sample(
    arm: str, workload: str, template: str, step: int, turn: Turn, after_restart: bool, stats: list[RequestStats]
) -> TurnSample:
    return TurnSample(
        arm=arm,
        workload=workload,
        template=template,
        step=step,
        agent=turn.agent,
        turn=turn.index,
        new_conversation=turn.new_conversation,
        after_restart=after_restart,
        requests=len(stats),
        latency_s=sum(s.latency_s for s in stats),
        prompt_tokens=max(s.prompt_tokens for s in stats),
        processed_tokens=sum(s.processed_tokens for s in stats),
        new_tokens=sum(s.new_tokens for s in stats),
        output_tokens=sum(s.output_tokens for s in stats),
    )


def _versions() -> dict[str, Any]:
    import kakeya

    versions: dict[str, Any] = {"kakeya_sdk": kakeya.__version__}
    try:
        import mlx_lm

        versions["mlx_lm"] = mlx_lm.__version__
    except ImportError:
        versions["mlx_lm"] = None
    if LLAMA_SERVER.is_file():
        found = subprocess.run([str(LLAMA_SERVER), "--version"], capture_output=True, text=True, check=False)
        versions["llama_server"] = (found.stdout + found.stderr).strip().splitlines()[:1]
    return versions


def _workloads(text: str) -> list[tuple[int, int]]:
    workloads = []
    for part in text.split(","):
        agents, _, turns = part.partition("x")
        if not (agents.isdigit() and turns.isdigit()) or int(agents) < 1 or int(turns) < 1:
            raise argparse.ArgumentTypeError(f"{part!r} is not AGENTSxTURNS (e.g. 8x30)")
        workloads.append((int(agents), int(turns)))
    return workloads


def _names(choices: Sequence[str]) -> Any:
    def parse(text: str) -> list[str]:
        names = [n for n in text.split(",") if n]
        unknown = sorted(set(names) - set(choices))
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"expected names among {', '.join(choices)}, got {text!r}")
        return names

    return parse


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(parser, "the model every arm serves")
    parser.add_argument("--arms", type=_names(ARMS), default=list(ARMS), help="comma-separated (default: all)")
    parser.add_argument("--workloads", type=_workloads, default=[(1, 60), (8, 30)], help="AGENTSxTURNS,... (1x60,8x30)")
    parser.add_argument("--templates", type=_names(tuple(TEMPLATES)), default=list(TEMPLATES), help="(both)")
    add_transcript_options(parser)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of every server (default: %(default)s)")
    parser.add_argument("--restart-at", type=float, default=0.5, help="restart after this share of a run (0: none)")
    parser.add_argument("--gguf", type=Path, help="llama-server's model (default: the GGUF --model was made from)")
    parser.add_argument("--weights", default="auto", help="our daemon's --weights (default: %(default)s)")
    parser.add_argument("--daemon-args", default="", help="more flags for our daemon (ours and shim), one string")
    parser.add_argument("--llama-slots", type=int, default=4, help="llama-server --parallel (its own automatic choice)")
    parser.add_argument("--llama-context-tokens", type=int, default=0, help="0: slots x (--max-history-tokens + 512)")
    parser.add_argument("--llama-cache-ram-mib", type=int, default=8192, help="llama-server --cache-ram")
    parser.add_argument("--llama-cache-reuse", type=int, default=256, help="llama-server --cache-reuse")
    parser.add_argument("--llama-args", default="", help="more flags for llama-server, one string")
    parser.add_argument("--mlx-prompt-cache-size", type=int, default=10, help="mlx_lm.server --prompt-cache-size")
    parser.add_argument(
        "--mlx-bits", type=int, choices=(0, 4, 8), default=0, help="quantize the MLX copy (0: float32; %(default)s)"
    )
    parser.add_argument("--mlx-blas", default="auto", help="MLX's CPU BLAS for mlx_lm.server (as --mlx-blas)")
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if args.threads < 1 or args.llama_slots < 1 or not 0 <= args.restart_at < 1:
        parser.error("--threads and --llama-slots must be >= 1, --restart-at in [0, 1)")
    if args.gguf is None:
        manifest = Path(args.model) / "kakeya-model.json"
        source = json.loads(manifest.read_text()).get("source") if manifest.is_file() else None
        args.gguf = Path(source) if source and Path(source).is_file() else None
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so every server this run started is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    with tempfile.TemporaryDirectory(prefix="kakeya-bench-vs-peers-") as workdir:
        path = Bench(args, tokenizer, Path(workdir)).run()
    summary = json.loads(path.read_text())["summary"]
    print(json.dumps({"ours_wall_over": summary["ours_wall_over"], "gates": summary["gates"]}, indent=2))
    print(f"wrote {path} and {path.with_suffix('.png').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
