// Every conversion between the SDK's types and the generated protocol messages. Values the wire would silently
// alter (a fractional or negative uint32, a seed outside 64 bits) are rejected here; everything else the server checks.
import { InvalidArgumentError } from "./errors.js";
import {
  type CreateSessionRequest,
  type GenerateCommand,
  type GenerateDone,
  type GetModelInfoResponse,
  type GetSessionInfoResponse,
  type GrammarConstraint,
  KvCompressor as WireKvCompressor,
  KvStrategy as WireKvStrategy,
  StopReason as WireStopReason,
  type TokenLogprobs as WireTokenLogprobs,
} from "./generated/kakeya/v1/runtime.js";
import type {
  CreateSessionOptions,
  GenerationStats,
  Grammar,
  KvCompressor,
  KvStrategy,
  ModelInfo,
  SamplingOptions,
  SessionInfo,
  StopReason,
  TokenLogprobs,
} from "./types.js";

const UINT32_MAX = 0xffff_ffff;
const UINT64_LIMIT = 1n << 64n;

function uint32(value: number, what: string): number {
  if (!Number.isInteger(value) || value < 0 || value > UINT32_MAX) {
    throw new InvalidArgumentError(`${what} must be an integer in [0, 2^32), got ${value}`);
  }
  return value;
}

/** Token ids as the wire carries them (uint32), each checked. */
export function tokenIds(values: Iterable<number> | undefined, what: string): number[] {
  if (values === undefined) return [];
  if (typeof values === "string" || typeof (values as Iterable<number>)[Symbol.iterator] !== "function") {
    throw new InvalidArgumentError(`${what} must be an iterable of token ids`);
  }
  return Array.from(values, (value, index) => uint32(value, `${what}[${index}]`));
}

function optionalUint32(value: number | undefined, what: string): number | undefined {
  return value === undefined ? undefined : uint32(value, what);
}

function seed(value: number | bigint | undefined): bigint | undefined {
  if (value === undefined) return undefined;
  if (typeof value === "number" && !Number.isSafeInteger(value)) {
    throw new InvalidArgumentError(`seed must be a safe integer or a bigint, got ${value}`);
  }
  const big = BigInt(value);
  if (big < 0n || big >= UINT64_LIMIT) throw new InvalidArgumentError(`seed must fit in 64 unsigned bits, got ${big}`);
  return big;
}

/** Duration in milliseconds checked to be usable as a timer or deadline. */
export function milliseconds(value: number | undefined, what: string): number | undefined {
  if (value === undefined) return undefined;
  if (!Number.isFinite(value) || value < 0)
    throw new InvalidArgumentError(`${what} must be finite and >= 0, got ${value}`);
  return value;
}

const STRATEGIES: Record<KvStrategy, WireKvStrategy> = {
  full: WireKvStrategy.KV_STRATEGY_FULL,
  sink_window: WireKvStrategy.KV_STRATEGY_SINK_WINDOW,
  dlm_restore: WireKvStrategy.KV_STRATEGY_DLM_RESTORE,
};

const COMPRESSORS: Record<KvCompressor, WireKvCompressor> = {
  none: WireKvCompressor.KV_COMPRESSOR_NONE,
  kakeya_d4: WireKvCompressor.KV_COMPRESSOR_KAKEYA_D4,
  kakeya_e8: WireKvCompressor.KV_COMPRESSOR_KAKEYA_E8,
  kakeya_d4s: WireKvCompressor.KV_COMPRESSOR_KAKEYA_D4S,
  kakeya_e8s: WireKvCompressor.KV_COMPRESSOR_KAKEYA_E8S,
};

const COMPRESSOR_NAMES = new Map<WireKvCompressor, KvCompressor>(
  Object.entries(COMPRESSORS).map(([name, wire]) => [wire, name as KvCompressor]),
);

export function createSessionRequest(options: CreateSessionOptions): CreateSessionRequest {
  let compressor = WireKvCompressor.KV_COMPRESSOR_UNSPECIFIED;
  if (options.kvCompressor !== undefined) {
    const wire = COMPRESSORS[options.kvCompressor];
    if (wire === undefined) {
      throw new InvalidArgumentError(`unknown kvCompressor ${JSON.stringify(options.kvCompressor)}`);
    }
    compressor = wire;
  }
  let strategy = WireKvStrategy.KV_STRATEGY_UNSPECIFIED;
  if (options.kvStrategy !== undefined) {
    const wire = STRATEGIES[options.kvStrategy];
    if (wire === undefined) throw new InvalidArgumentError(`unknown kvStrategy ${JSON.stringify(options.kvStrategy)}`);
    strategy = wire;
  }
  const eos = options.eosTokenIds === undefined ? undefined : tokenIds(options.eosTokenIds, "eosTokenIds");
  return {
    clientLabel: options.label ?? "",
    eosTokenIds: eos ?? [],
    // Unset takes the model's EOS ids; an empty list asks for none at all.
    noDefaultEos: eos !== undefined && eos.length === 0,
    initialTokenIds: tokenIds(options.initialTokens, "initialTokens"),
    kvStrategy: strategy,
    sinkTokens: optionalUint32(options.sinkTokens, "sinkTokens"),
    windowTokens: optionalUint32(options.windowTokens, "windowTokens"),
    kvCompressor: compressor,
    kvQRange: optionalUint32(options.kvQRange, "kvQRange"),
  };
}

/** The sampling fields shared by `GenerateRequest` and the Converse `GenerateCommand`; `maxTokens` must be in
 * 1..`maxGenerateTokens` (the server's limit, when known). */
export function generateCommand(options: SamplingOptions, maxGenerateTokens?: number): GenerateCommand {
  if (options === null || typeof options !== "object") {
    throw new InvalidArgumentError("generate needs an options object with maxTokens");
  }
  const upper = maxGenerateTokens ?? 2 ** 32 - 1;
  const maxTokens = options.maxTokens;
  if (!Number.isInteger(maxTokens) || maxTokens < 1 || maxTokens > upper) {
    const range = maxGenerateTokens === undefined ? `1..${upper}` : `1..${upper} (the server's limit)`;
    throw new InvalidArgumentError(`maxTokens must be an integer in ${range}, got ${String(maxTokens)}`);
  }
  return {
    maxTokens,
    seed: seed(options.seed),
    temperature: options.temperature,
    topP: options.topP,
    topK: optionalUint32(options.topK, "topK"),
    stopTokenIds: tokenIds(options.stopTokenIds, "stopTokenIds"),
    grammar: grammarConstraint(options.grammar),
    stopSequences: [...(options.stopSequences ?? [])].map((ids, i) => ({
      tokenIds: tokenIds(ids, `stopSequences[${i}]`),
    })),
    logprobs: options.logprobs ?? false,
    topLogprobs: options.topLogprobs === undefined ? 0 : uint32(options.topLogprobs, "topLogprobs"),
    repetitionPenalty: options.repetitionPenalty,
    presencePenalty: options.presencePenalty,
    frequencyPenalty: options.frequencyPenalty,
    penaltyWindowTokens: optionalUint32(options.penaltyWindowTokens, "penaltyWindowTokens"),
    minP: options.minP,
  };
}

function grammarConstraint(grammar: Grammar | undefined): GrammarConstraint | undefined {
  if (grammar === undefined) return undefined;
  if ("jsonSchema" in grammar) {
    const text = typeof grammar.jsonSchema === "string" ? grammar.jsonSchema : JSON.stringify(grammar.jsonSchema);
    return { grammar: { $case: "jsonSchema", value: text } };
  }
  if ("regex" in grammar) return { grammar: { $case: "regex", value: grammar.regex } };
  if ("lark" in grammar) return { grammar: { $case: "lark", value: grammar.lark } };
  if ("gbnf" in grammar) return { grammar: { $case: "gbnf", value: grammar.gbnf } };
  throw new InvalidArgumentError("grammar must be one of { jsonSchema }, { regex }, { lark } or { gbnf }");
}

export function tokenLogprobs(scored: WireTokenLogprobs): TokenLogprobs {
  return {
    tokenId: scored.tokenId,
    logprob: scored.logprob,
    topLogprobs: scored.topLogprobs.map((a) => ({ tokenId: a.tokenId, logprob: a.logprob })),
  };
}

export function historyTailTokens(value: number | undefined): number {
  return value === undefined ? 0 : uint32(value, "historyTailTokens");
}

/** A `ForkSessionRequest` for `sessionId`; unset options keep the parent's whole history and label. */
export function forkRequest(
  sessionId: string,
  options: { prefixTokens?: number; label?: string },
): { sessionId: string; prefixTokens?: bigint; clientLabel?: string } {
  const request: { sessionId: string; prefixTokens?: bigint; clientLabel?: string } = { sessionId };
  if (options.prefixTokens !== undefined) {
    const prefix = options.prefixTokens;
    if (!Number.isSafeInteger(prefix) || prefix < 0) {
      throw new InvalidArgumentError(`prefixTokens must be a non-negative integer, got ${prefix}`);
    }
    request.prefixTokens = BigInt(prefix);
  }
  if (options.label !== undefined) request.clientLabel = options.label;
  return request;
}

/** A uint64 count as a number (exact up to 2^53, far above any history or byte count a server holds). */
export function count(value: bigint): number {
  return Number(value);
}

const STOP_REASONS = new Map<WireStopReason, StopReason>([
  [WireStopReason.STOP_REASON_MAX_TOKENS, "max_tokens"],
  [WireStopReason.STOP_REASON_EOS, "eos"],
  [WireStopReason.STOP_REASON_CANCELLED, "cancelled"],
  [WireStopReason.STOP_REASON_TRUNCATED, "truncated"],
  [WireStopReason.STOP_REASON_STOP_SEQUENCE, "stop_sequence"],
  [WireStopReason.STOP_REASON_GRAMMAR_DEAD_END, "grammar_dead_end"],
]);

export function generationStats(done: GenerateDone, droppedTokenCount: number): GenerationStats {
  return {
    stopReason: STOP_REASONS.get(done.stopReason) ?? "unspecified",
    generatedTokenCount: done.generatedTokenCount,
    prefillTokenCount: done.prefillTokenCount,
    prefillSeconds: done.prefillDurationSeconds,
    totalSeconds: done.totalDurationSeconds,
    timeToFirstTokenSeconds: done.timeToFirstTokenSeconds,
    draftTokenCount: done.draftTokenCount,
    acceptedDraftTokenCount: done.acceptedDraftTokenCount,
    verifierForwardCount: done.verifierForwardCount,
    droppedTokenCount,
    ...(done.stopSequenceIndex === undefined ? {} : { stopSequenceIndex: done.stopSequenceIndex }),
  };
}

const STRATEGY_NAMES = new Map<WireKvStrategy, KvStrategy>([
  [WireKvStrategy.KV_STRATEGY_FULL, "full"],
  [WireKvStrategy.KV_STRATEGY_SINK_WINDOW, "sink_window"],
  [WireKvStrategy.KV_STRATEGY_DLM_RESTORE, "dlm_restore"],
]);

export function modelInfo(response: GetModelInfoResponse): ModelInfo {
  const limits = response.limits;
  return {
    vocabSize: response.vocabSize,
    eosTokenIds: [...response.eosTokenIds],
    trainedContextTokens: count(response.trainedContextTokens),
    backend: response.backend,
    modelName: response.modelName,
    description: response.description,
    chatTemplate: response.chatTemplate,
    defaultKvStrategy: STRATEGY_NAMES.get(response.defaultKvStrategy) ?? "unspecified",
    defaultSinkTokens: response.defaultSinkTokens,
    defaultWindowTokens: response.defaultWindowTokens,
    limits: {
      maxGenerateTokens: limits?.maxGenerateTokens ?? 0,
      maxAppendTokens: limits?.maxAppendTokens ?? 0,
      maxHistoryTokens: count(limits?.maxHistoryTokens ?? 0n),
      maxSessions: limits?.maxSessions ?? 0,
      maxMessageBytes: count(limits?.maxMessageBytes ?? 0n),
      maxConcurrentGenerations: limits?.maxConcurrentGenerations ?? 0,
      queueDeadlineSeconds: limits?.queueDeadlineSeconds ?? 0,
      maxBatchSize: limits?.maxBatchSize ?? 0,
      prefillChunkTokens: limits?.prefillChunkTokens ?? 0,
    },
    proposer: response.proposer,
    serverVersion: response.serverVersion,
  };
}

export function sessionInfo(response: GetSessionInfoResponse): SessionInfo {
  return {
    historyLength: count(response.historyLength),
    kvLiveBytes: count(response.kvLiveBytes),
    kvCompressedBytes: count(response.kvCompressedBytes),
    kvStrategy: STRATEGY_NAMES.get(response.kvStrategy) ?? "unspecified",
    residentTokenCount: count(response.residentTokenCount),
    pendingTokenCount: count(response.pendingTokenCount),
    evictedTokenCount: count(response.evictedTokenCount),
    sinkTokens: response.sinkTokens,
    windowTokens: response.windowTokens,
    clientLabel: response.clientLabel,
    generating: response.generating,
    idleSeconds: response.idleSeconds,
    inv1Violations: count(response.cacheInvariantInv1Violations),
    inv2Violations: count(response.cacheInvariantInv2Violations),
    historyTail: [...response.historyTailTokenIds],
    kvCompressor: COMPRESSOR_NAMES.get(response.kvCompressor) ?? "unspecified",
    kvQRange: response.kvQRange,
    kvDenseEquivalentBytes: count(response.kvDenseEquivalentBytes),
    kvEscapedBlocks: count(response.kvEscapedBlocks),
    restoredTokenCount: count(response.restoredTokenCount),
    kvResidentBytes: count(response.kvResidentBytes),
    kvRestoredBytes: count(response.kvRestoredBytes),
    kvRestorationStateBytes: count(response.kvRestorationStateBytes),
    kvPeakRestoredBytes: count(response.kvPeakRestoredBytes),
    historyTokenBytes: count(response.historyTokenBytes),
    kvPeakBytes: count(response.kvPeakBytes),
    draftStateBytes: count(response.draftStateBytes),
  };
}
