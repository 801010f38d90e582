// Every conversion between the SDK's types and the generated protocol messages. Values the wire would silently
// alter (a fractional or negative uint32, a seed outside 64 bits) are rejected here; everything else the server checks.
import { InvalidArgumentError } from "./errors.js";
import {
  type CreateSessionRequest,
  type GenerateCommand,
  type GenerateDone,
  type GetSessionInfoResponse,
  KvCompressor as WireKvCompressor,
  KvStrategy as WireKvStrategy,
  StopReason as WireStopReason,
} from "./generated/kakeya/v1/runtime.js";
import type {
  CreateSessionOptions,
  GenerationStats,
  KvCompressor,
  KvStrategy,
  SamplingOptions,
  SessionInfo,
  StopReason,
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
};

const COMPRESSORS: Record<KvCompressor, WireKvCompressor> = {
  none: WireKvCompressor.KV_COMPRESSOR_NONE,
  kakeya_d4: WireKvCompressor.KV_COMPRESSOR_KAKEYA_D4,
  kakeya_e8: WireKvCompressor.KV_COMPRESSOR_KAKEYA_E8,
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
  return {
    clientLabel: options.label ?? "",
    eosTokenIds: tokenIds(options.eosTokenIds, "eosTokenIds"),
    initialTokenIds: tokenIds(options.initialTokens, "initialTokens"),
    kvStrategy: strategy,
    sinkTokens: optionalUint32(options.sinkTokens, "sinkTokens"),
    windowTokens: optionalUint32(options.windowTokens, "windowTokens"),
    kvCompressor: compressor,
    kvQRange: optionalUint32(options.kvQRange, "kvQRange"),
  };
}

/** The sampling fields shared by `GenerateRequest` and the Converse `GenerateCommand`. */
export function generateCommand(options: SamplingOptions): GenerateCommand {
  if (options === null || typeof options !== "object") {
    throw new InvalidArgumentError("generate needs an options object with maxTokens");
  }
  return {
    maxTokens: uint32(options.maxTokens, "maxTokens"),
    seed: seed(options.seed),
    temperature: options.temperature,
    topP: options.topP,
    topK: optionalUint32(options.topK, "topK"),
    stopTokenIds: tokenIds(options.stopTokenIds, "stopTokenIds"),
  };
}

export function historyTailTokens(value: number | undefined): number {
  return value === undefined ? 0 : uint32(value, "historyTailTokens");
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
  };
}

const STRATEGY_NAMES = new Map<WireKvStrategy, KvStrategy>([
  [WireKvStrategy.KV_STRATEGY_FULL, "full"],
  [WireKvStrategy.KV_STRATEGY_SINK_WINDOW, "sink_window"],
]);

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
  };
}
