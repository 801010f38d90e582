"""Prometheus metrics of the daemon, held in one registry owned by the server (no module-level state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_ACCEPT_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)
_RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.5, 2.0, 4.0)


class Metrics:
    """Every metric the daemon exports. Counter names gain the `_total` suffix on the wire."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.session_active = Gauge("session_active", "Sessions currently allocated", registry=r)
        self.session_total = Counter("session", "Sessions that ended, by outcome", ["outcome"], registry=r)
        self.sessions_opened = Counter("sessions_opened", "Sessions created", registry=r)
        self.session_kv_live_bytes = Gauge(
            "session_kv_live_bytes", "KV cache bytes held across allocated sessions", registry=r
        )
        self.session_history_tokens = Histogram(
            "session_history_tokens", "Session history length at generate time", buckets=_TOKEN_BUCKETS, registry=r
        )
        self.generate_prefill_tokens = Histogram(
            "generate_prefill_tokens", "Pending tokens prefilled per generation", buckets=_TOKEN_BUCKETS, registry=r
        )
        self.generate_prefill_duration_seconds = Histogram(
            "generate_prefill_duration_seconds",
            "Wall time of the prefill phase per generation",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.generate_time_to_first_token_seconds = Histogram(
            "generate_time_to_first_token_seconds",
            "Time from the start of a generation to its first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.generate_inter_token_latency_seconds = Histogram(
            "generate_inter_token_latency_seconds",
            "Time between consecutive generated tokens",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.generate_tokens = Counter("generate_tokens", "Tokens generated", registry=r)
        self.generate_requests = Counter(
            "generate_requests", "Generations that ended, by stop reason or error", ["outcome"], registry=r
        )
        self.cache_invariant_violations = Counter(
            "cache_invariant_violations", "Cache invariant violations, by invariant", ["kind"], registry=r
        )
        self.session_evicted = Counter("session_evicted", "Sessions evicted, by reason", ["reason"], registry=r)
        self.speculative_drafts = Counter("speculative_drafts", "Decode steps that verified a draft", registry=r)
        self.speculative_draft_tokens = Counter("speculative_draft_tokens", "Tokens drafted", registry=r)
        self.speculative_accepted_tokens = Counter(
            "speculative_accepted_tokens", "Drafted tokens accepted by the verifier", registry=r
        )
        self.speculative_acceptance_length = Histogram(
            "speculative_acceptance_length",
            "Accepted draft tokens per verified draft",
            buckets=_ACCEPT_BUCKETS,
            registry=r,
        )
        self.verifier_forwards = Counter("verifier_forwards", "Verifier forward passes", registry=r)
        self.generate_verifier_forwards_per_token = Histogram(
            "generate_verifier_forwards_per_token",
            "Verifier forwards per generated token, per generation (prefill forwards included)",
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.kv_compression_ratio = Gauge(
            "kv_compression_ratio",
            "Uncompressed over held bytes of the resident KV caches (1 = uncompressed)",
            registry=r,
        )
        self.kv_compressed_bytes = Gauge(
            "kakeya_kv_compressed_bytes",
            "Bytes of packed KV (KakeyaLattice codes, scales, escapes) the sessions hold",
            registry=r,
        )
        self.kv_dense_equivalent_bytes = Gauge(
            "kakeya_kv_dense_equivalent_bytes",
            "Bytes the sessions' resident K/V would take dense in the model's dtype",
            registry=r,
        )
        self.kv_escaped_blocks = Gauge(
            "kakeya_kv_escaped_blocks",
            "Lattice blocks held by escape (off the lattice after clamping) across sessions",
            registry=r,
        )
        for kind in ("inv1", "inv2"):
            self.cache_invariant_violations.labels(kind=kind)
        for reason in ("ttl", "lru", "budget"):
            self.session_evicted.labels(reason=reason)
        for outcome in ("closed", "evicted", "failed"):
            self.session_total.labels(outcome=outcome)
        self.kv_compression_ratio.set(1.0)
