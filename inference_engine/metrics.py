"""Prometheus metrics of the daemon, held in one registry owned by the server (no module-level state).

Every name starts with `kakeya_`. The registry leaves out the `_created` series the client library adds to
counters and histograms: they hold creation timestamps, which dashboards misread as counts.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

from kv_cache_proposer.proposers.cost_model import DraftDecision

_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_ACCEPT_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)
_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
_RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.5, 2.0, 4.0)


class MetricsRegistry(CollectorRegistry):
    """A registry whose exposition has no `_created` samples."""

    def collect(self) -> Iterable[Metric]:
        for metric in super().collect():
            if any(sample.name.endswith("_created") for sample in metric.samples):
                metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric


class Metrics:
    """Every metric the daemon exports. Counter names gain the `_total` suffix on the wire."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or MetricsRegistry()
        r = self.registry
        self.session_active = Gauge("kakeya_session_active", "Sessions currently allocated", registry=r)
        self.session_total = Counter(
            "kakeya_session", "Sessions that ended, by outcome (closed, evicted, failed)", ["outcome"], registry=r
        )
        self.session_opened = Counter("kakeya_session_opened", "Sessions created (restored ones included)", registry=r)
        self.session_kv_live_bytes = Gauge(
            "kakeya_session_kv_live_bytes", "KV cache bytes held across allocated sessions", registry=r
        )
        self.session_kv_written_positions = Counter(
            "kakeya_session_kv_written_positions",
            "Positions whose K/V parked sessions wrote to their files under --state-dir (--state-kv)",
            registry=r,
        )
        self.session_kv_file_bytes = Gauge(
            "kakeya_session_kv_file_bytes",
            "Bytes of the sessions' K/V files under --state-dir (--state-kv), at most --state-kv-max-bytes",
            registry=r,
        )
        self.session_kv_read_back_positions = Counter(
            "kakeya_session_kv_read_back_positions",
            "Positions whose K/V sessions restored from the journal read back from their files instead of prefilling",
            registry=r,
        )
        self.session_prefix_reused_positions = Counter(
            "kakeya_session_prefix_reused_positions",
            "Positions whose K/V a session's first generation copied from an idle session with the same history prefix",
            registry=r,
        )
        self.session_history_tokens = Histogram(
            "kakeya_session_history_tokens",
            "Session history length at generate time",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.generate_prefill_tokens = Histogram(
            "kakeya_generate_prefill_tokens",
            "Pending tokens prefilled per generation",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.generate_prefill_duration_seconds = Histogram(
            "kakeya_generate_prefill_duration_seconds",
            "Wall time of the prefill phase per generation",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.generate_time_to_first_token_seconds = Histogram(
            "kakeya_generate_time_to_first_token_seconds",
            "Time from the start of a generation to its first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.generate_inter_token_latency_seconds = Histogram(
            "kakeya_generate_inter_token_latency_seconds",
            "Time between consecutive generated tokens",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.generate_tokens = Counter("kakeya_generate_tokens", "Tokens generated", registry=r)
        self.generate_requests = Counter(
            "kakeya_generate_requests", "Generations that ended, by stop reason or error", ["outcome"], registry=r
        )
        self.batch_size = Histogram(
            "kakeya_batch_size",
            "Generation steps (one per session) run in one verifier forward",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.batch_forwards = Counter(
            "kakeya_batch_forwards", "Batched verifier forwards the engine loop ran (rate: forwards/s)", registry=r
        )
        self.batch_queue_wait_seconds = Histogram(
            "kakeya_batch_queue_wait_seconds",
            "Time from a generation's previous step (or its start) to the forward that runs its next",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.cache_invariant_violations = Counter(
            "kakeya_cache_invariant_violations", "Cache invariant violations, by invariant", ["kind"], registry=r
        )
        self.session_evicted = Counter("kakeya_session_evicted", "Sessions evicted, by reason", ["reason"], registry=r)
        self.speculative_drafts = Counter("kakeya_speculative_drafts", "Decode steps that verified a draft", registry=r)
        self.speculative_draft_tokens = Counter("kakeya_speculative_draft_tokens", "Tokens drafted", registry=r)
        self.speculative_accepted_tokens = Counter(
            "kakeya_speculative_accepted_tokens", "Drafted tokens accepted by the verifier", registry=r
        )
        self.speculative_decisions = Counter(
            "kakeya_speculative_decisions",
            "Decode steps whose draft length the cost policy chose, by decision (draft, decline, probe)",
            ["decision"],
            registry=r,
        )
        self.speculative_acceptance_length = Histogram(
            "kakeya_speculative_acceptance_length",
            "Accepted draft tokens per verified draft",
            buckets=_ACCEPT_BUCKETS,
            registry=r,
        )
        self.verifier_forwards = Counter("kakeya_verifier_forwards", "Verifier forward passes", registry=r)
        self.generate_verifier_forwards_per_token = Histogram(
            "kakeya_generate_verifier_forwards_per_token",
            "Verifier forwards per generated token, per generation (prefill forwards included)",
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.kv_compression_ratio = Gauge(
            "kakeya_kv_compression_ratio",
            "Uncompressed over held bytes of the resident KV caches (1 = uncompressed)",
            registry=r,
        )
        self.generate_queue_depth = Gauge(
            "kakeya_generate_queue_depth",
            "Generations waiting for their session or a generation slot",
            registry=r,
        )
        self.generate_queue_wait_seconds = Histogram(
            "kakeya_generate_queue_wait_seconds",
            "Time a generation waited for its session and a generation slot",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.build_info = Gauge(
            "kakeya_build_info",
            "Always 1; the labels name the server version and the model it serves",
            ["version", "backend", "model", "proposer", "kv_strategy"],
            registry=r,
        )
        self.kv_compressed_bytes = Gauge(
            "kakeya_kv_compressed_bytes",
            "Bytes of packed KV (KakeyaLattice codes, scales, escapes) the sessions hold",
            registry=r,
        )
        self.kv_dense_equivalent_bytes = Gauge(
            "kakeya_kv_dense_equivalent_bytes",
            "Bytes the sessions' resident K/V would take dense: a dense session's own (bfloat16 under --kv-dtype "
            "bfloat16), a compressed session's K/V in the model's dtype",
            registry=r,
        )
        self.kv_escaped_blocks = Gauge(
            "kakeya_kv_escaped_blocks",
            "Lattice blocks held by escape (off the lattice after clamping) across sessions",
            registry=r,
        )
        self.kv_resident_bytes = Gauge(
            "kakeya_kv_resident_bytes", "Bytes of resident K/V (and slot tables) the sessions hold", registry=r
        )
        self.kv_restored_bytes = Gauge(
            "kakeya_kv_restored_bytes",
            "Bytes of restored K/V of evicted positions held now by dlm_restore sessions (transient: while they "
            "generate)",
            registry=r,
        )
        self.kv_restored_peak_bytes = Gauge(
            "kakeya_kv_restored_peak_bytes",
            "The most bytes of restored K/V one held dlm_restore session has held at once (its per-step peak)",
            registry=r,
        )
        self.kv_session_peak_bytes = Gauge(
            "kakeya_kv_session_peak_bytes",
            "The most KV bytes one held session has held at once (after each step of its generations): what a "
            "generating session needs",
            registry=r,
        )
        self.kv_restoration_state_bytes = Gauge(
            "kakeya_kv_restoration_state_bytes",
            "Bytes of per-position state dlm_restore sessions keep to restore evicted positions (kept layers' K/V)",
            registry=r,
        )
        self.history_token_bytes = Gauge(
            "kakeya_history_token_bytes",
            "Bytes of history token ids dlm_restore sessions keep to rebuild evicted K/V by a forward",
            registry=r,
        )
        self.draft_state_bytes = Gauge(
            "kakeya_draft_state_bytes",
            "Bytes proposers hold for the sessions: drafters' and draft models' K/V, n-gram indexes",
            registry=r,
        )
        for kind in ("inv1", "inv2"):
            self.cache_invariant_violations.labels(kind=kind)
        for reason in ("ttl", "lru", "budget"):
            self.session_evicted.labels(reason=reason)
        for decision in DraftDecision:
            self.speculative_decisions.labels(decision=decision.value)
        for outcome in ("closed", "evicted", "failed"):
            self.session_total.labels(outcome=outcome)
        for outcome in ("max_tokens", "eos", "cancelled", "truncated", "failed", "resource_exhausted"):
            self.generate_requests.labels(outcome=outcome)
        self.kv_compression_ratio.set(1.0)
