/** Options every call accepts. */
export interface CallOptions {
  /** Deadline of the call in milliseconds from now; for unary calls it defaults to the client's `timeoutMs`. */
  timeoutMs?: number;
  /** Aborting the signal cancels the call, which then rejects with `CancelledError`. */
  signal?: AbortSignal;
}

/** How a session's KV cache is held on the server; unset uses the server's default. */
export type KvStrategy = "full" | "sink_window";

/** How a session's committed K/V are held: dense, or packed KakeyaLattice codes; unset uses the server's default. */
export type KvCompressor = "none" | "kakeya_d4" | "kakeya_e8";

export interface CreateSessionOptions extends CallOptions {
  /** Free-form label shown in the server's logs and in `SessionInfo.clientLabel`. */
  label?: string;
  /** Token ids that end every generation of the session with stop reason `eos`. */
  eosTokenIds?: Iterable<number>;
  /** History the session starts with (prefilled by its first generation). */
  initialTokens?: Iterable<number>;
  kvStrategy?: KvStrategy;
  /** Leading positions that stay resident under `sink_window`. */
  sinkTokens?: number;
  /** Most recent positions that stay resident under `sink_window`. */
  windowTokens?: number;
  kvCompressor?: KvCompressor;
  /** Lattice range Q of a KakeyaLattice compressor (larger: more bits, less error). */
  kvQRange?: number;
}

export interface SamplingOptions {
  /** Number of tokens to generate at most (1 .. the server's `--max-generate-tokens`). */
  maxTokens: number;
  /** Seed of the sampler: the same history, seed and parameters give the same tokens. Unset draws a fresh one. */
  seed?: number | bigint;
  /** Sampling temperature; unset or 0 decodes greedily. */
  temperature?: number;
  /** Nucleus sampling mass in (0, 1]. */
  topP?: number;
  /** Keep only the k most likely tokens; 0 means no limit. */
  topK?: number;
  /** Extra token ids that end this generation with stop reason `eos` (the token is streamed). */
  stopTokenIds?: Iterable<number>;
}

export interface GenerateOptions extends SamplingOptions {
  /** Aborting the signal cancels the generation; the iteration then throws `CancelledError`. */
  signal?: AbortSignal;
  /** Longest wait for the next token (the first one included); exceeding it cancels and throws
   * `InterTokenTimeoutError`. Unset waits indefinitely. */
  interTokenTimeoutMs?: number;
  /** Deadline of the whole generation in milliseconds; unset means none. */
  timeoutMs?: number;
}

export interface SessionInfoOptions extends CallOptions {
  /** Number of trailing history tokens to return in `historyTail`. */
  historyTailTokens?: number;
}

/** Why a generation ended. */
export type StopReason = "max_tokens" | "eos" | "cancelled" | "truncated" | "unspecified";

/** The statistics the server reports at the end of a generation. */
export interface GenerationStats {
  stopReason: StopReason;
  generatedTokenCount: number;
  /** Pending history tokens this generation prefilled. */
  prefillTokenCount: number;
  prefillSeconds: number;
  /** Wall time of the generation, queueing excluded. */
  totalSeconds: number;
  timeToFirstTokenSeconds: number;
  /** Tokens drafted by the server's proposer, and how many of them the verifier accepted. */
  draftTokenCount: number;
  acceptedDraftTokenCount: number;
  verifierForwardCount: number;
  /** History positions no longer resident in the session's cache when the generation started (0: none). */
  droppedTokenCount: number;
}

/** A session as the server describes it. */
export interface SessionInfo {
  historyLength: number;
  /** Bytes of KV cache the session holds on the server. */
  kvLiveBytes: number;
  kvCompressedBytes: number;
  kvStrategy: KvStrategy | "unspecified";
  /** Positions whose K/V are resident; fewer than `historyLength` under a bounded strategy. */
  residentTokenCount: number;
  /** Appended tokens the next generation will prefill. */
  pendingTokenCount: number;
  evictedTokenCount: number;
  sinkTokens: number;
  windowTokens: number;
  clientLabel: string;
  /** Whether a generation is running on the session. */
  generating: boolean;
  idleSeconds: number;
  /** Cache invariant violations observed on the session (a violation fails the session). */
  inv1Violations: number;
  inv2Violations: number;
  /** The last `historyTailTokens` history tokens. */
  historyTail: number[];
  kvCompressor: KvCompressor | "unspecified";
  /** Lattice range Q of the session's compressor (0: not compressed). */
  kvQRange: number;
  /** Bytes the resident K/V would take dense in the model's dtype. */
  kvDenseEquivalentBytes: number;
  /** Lattice blocks held by escape (off the lattice after clamping). */
  kvEscapedBlocks: number;
}
