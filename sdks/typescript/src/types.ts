/** Options every call accepts. */
export interface CallOptions {
  /** Deadline of the call in milliseconds from now; for unary calls it defaults to the client's `timeoutMs`. */
  timeoutMs?: number;
  /** Aborting the signal cancels the call, which then rejects with `CancelledError`. */
  signal?: AbortSignal;
}

/** How a session's KV cache is held on the server; unset uses the server's default. */
export type KvStrategy = "full" | "sink_window" | "dlm_restore";

export interface ForkOptions extends CallOptions {
  /** Length of the parent's history the fork keeps; unset keeps all of it. */
  prefixTokens?: number;
  /** Label of the fork; unset takes the parent's. */
  label?: string;
}
/** How a session's committed K/V are held: dense, or packed KakeyaLattice codes; unset uses the server's default. */
export type KvCompressor = "none" | "kakeya_d4" | "kakeya_e8" | "kakeya_d4s" | "kakeya_e8s";

export interface CreateSessionOptions extends CallOptions {
  /** Free-form label shown in the server's logs and in `SessionInfo.clientLabel`. */
  label?: string;
  /** Token ids that end every generation of the session with stop reason `eos`. Unset uses the model's
   * end-of-sequence ids (`ModelInfo.eosTokenIds`); an empty list gives the session none. */
  eosTokenIds?: Iterable<number>;
  /** History the session starts with (prefilled by its first generation). */
  initialTokens?: Iterable<number>;
  kvStrategy?: KvStrategy;
  /** Leading positions that stay resident under `sink_window` and `dlm_restore`. */
  sinkTokens?: number;
  /** Most recent positions that stay resident under `sink_window` and `dlm_restore`. */
  windowTokens?: number;
  kvCompressor?: KvCompressor;
  /** Lattice range Q of a KakeyaLattice compressor (larger: more bits, less error). */
  kvQRange?: number;
  /** Key sent with every call of the session (`x-kakeya-routing-key` metadata) so that a proxy in front of several
   * daemons sends them all to one daemon; unset picks a random one. Sessions given the same key share a daemon. */
  routingKey?: string;
}

/** The limits the server checks requests against. */
export interface ServerLimits {
  /** Largest `maxTokens` of a generation (the smallest is 1). */
  maxGenerateTokens: number;
  /** Tokens one append (or the initial tokens) may carry. */
  maxAppendTokens: number;
  /** History tokens a session may hold. */
  maxHistoryTokens: number;
  /** Sessions held at once; creating one more evicts the least recently used idle one. */
  maxSessions: number;
  /** Largest gRPC message the server receives or sends. */
  maxMessageBytes: number;
  /** Generations running at once across sessions. */
  maxConcurrentGenerations: number;
  /** Seconds a request may wait for its session or a generation slot. */
  queueDeadlineSeconds: number;
  /** Generation steps of concurrent sessions run in one verifier forward at most (0: a server that does not say). */
  maxBatchSize: number;
  /** Pending tokens one prefill forward takes (0: a server that does not say). */
  prefillChunkTokens: number;
}

/** The served model's facts and the server's session defaults and limits (`client.modelInfo()`). */
export interface ModelInfo {
  /** Token ids are in [0, vocabSize). */
  vocabSize: number;
  /** The model's end-of-sequence ids: the default `eosTokenIds` of new sessions. */
  eosTokenIds: number[];
  /** Context length the model was trained for (0 when the model does not say). */
  trainedContextTokens: number;
  backend: string;
  modelName: string;
  description: string;
  /** The tokenizer's chat template (Jinja source), when the model has one. */
  chatTemplate: string | undefined;
  defaultKvStrategy: KvStrategy | "unspecified";
  defaultSinkTokens: number;
  defaultWindowTokens: number;
  limits: ServerLimits;
  proposer: string;
  serverVersion: string;
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
  /** Constrain the output to a grammar; a completed grammar ends with the model's end-of-sequence token (`eos`). */
  grammar?: Grammar;
  /** Token-id sequences that end the generation after their first complete match (`stop_sequence`; streamed). */
  stopSequences?: Iterable<Iterable<number>>;
  /** Receive each token's log-probability (`TokenStream.logprobs`). */
  logprobs?: boolean;
  /** With `logprobs`: the N most likely alternatives per position (N up to the server's `--max-top-logprobs`). */
  topLogprobs?: number;
  /** Repetition penalty > 0 on tokens seen in the penalty window; 1 means none. */
  repetitionPenalty?: number;
  /** Subtracted from the logit of every token seen in the penalty window. */
  presencePenalty?: number;
  /** Subtracted from the logit of a token once per occurrence in the penalty window. */
  frequencyPenalty?: number;
  /** How many of the latest history tokens the penalties look at (server default 64). */
  penaltyWindowTokens?: number;
  /** Keep only tokens at least `minP` times as likely as the most likely one, in [0, 1]. */
  minP?: number;
}

/** A grammar for constrained decoding: a JSON schema (object or JSON text), a regex, Lark or GBNF. */
export type Grammar = { jsonSchema: object | string } | { regex: string } | { lark: string } | { gbnf: string };

/** A generated token's log-probability and the most likely alternatives at its position. */
export interface TokenLogprobs {
  tokenId: number;
  logprob: number;
  topLogprobs: { tokenId: number; logprob: number }[];
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
export type StopReason =
  "max_tokens" | "eos" | "cancelled" | "truncated" | "stop_sequence" | "grammar_dead_end" | "unspecified";

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
  /** With stop reason `stop_sequence`: the index of the stop sequence that matched. */
  stopSequenceIndex?: number;
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
  /** `dlm_restore`: evicted positions whose restored K/V the server holds now (0 while the session is parked). */
  restoredTokenCount: number;
  /** Bytes of resident K/V (part of `kvLiveBytes`). */
  kvResidentBytes: number;
  /** `dlm_restore`: bytes of restored K/V held now, transient (part of `kvLiveBytes`). */
  kvRestoredBytes: number;
  /** `dlm_restore`: bytes of the per-position state kept to restore evicted positions: the K/V of the plan's kept
   * layers (part of `kvLiveBytes`). */
  kvRestorationStateBytes: number;
  /** `dlm_restore`: the most bytes of restored K/V the session has held at once. */
  kvPeakRestoredBytes: number;
  /** `dlm_restore`: bytes of the history's token ids the server keeps to rebuild evicted K/V by a forward (part of
   * `kvLiveBytes`). */
  historyTokenBytes: number;
  /** The most bytes of KV cache memory the session has held at once (`kvLiveBytes` after each step of its
   * generations, and now): what it needs while it generates. */
  kvPeakBytes: number;
  /** Bytes the session's proposer holds: a drafter's or draft model's K/V, the `ngram` index (part of
   * `kvLiveBytes`; 0 without a proposer). */
  draftStateBytes: number;
}
