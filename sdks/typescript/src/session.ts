import { Conversation } from "./conversation.js";
import {
  count,
  forkRequest,
  generateCommand,
  historyTailTokens,
  sessionInfo,
  tokenIds,
  tokenLogprobs,
} from "./convert.js";
import { fromGrpcError } from "./errors.js";
import type { GenerateResponse } from "./generated/kakeya/v1/runtime.js";
import { EventQueue } from "./queue.js";
import { type GenerationEvent, type GenerationSource, TokenStream } from "./stream.js";
import type { Transport } from "./transport.js";
import type {
  CallOptions,
  ForkOptions,
  GenerateOptions,
  GenerationStats,
  SessionInfo,
  SessionInfoOptions,
} from "./types.js";

/** Translate one `GenerateResponse` into a generation event (`undefined` for a payload this SDK does not know). */
function generateEvent(response: GenerateResponse): GenerationEvent | undefined {
  const payload = response.payload;
  switch (payload?.$case) {
    case "tokenId":
      return { kind: "token", tokenId: payload.value };
    case "scoredToken":
      return { kind: "token", tokenId: payload.value.tokenId, logprobs: tokenLogprobs(payload.value) };
    case "truncated":
      return { kind: "truncated", droppedTokenCount: count(payload.value.droppedTokenCount) };
    case "done":
      return { kind: "done", done: payload.value };
    default:
      return undefined;
  }
}

/**
 * A session on the server: an append-only history of token ids and the KV cache that holds it.
 *
 * Obtained from `client.createSession()` (or `client.session(id)` for an existing id). Every method is one RPC;
 * the server is the source of truth, so a closed or evicted session fails with `SessionNotFoundError`.
 */
export class Session {
  /** History length after the last create, append or close this object made (the server's count). */
  historyLength: number | undefined;
  /** Statistics of this object's last generation that ended normally; reset when a new generation starts. */
  lastStats: GenerationStats | undefined;
  private finalHistoryLength: number | undefined;
  /** The key a proxy in front of several daemons routes this session's calls by (`x-kakeya-routing-key`). */
  readonly routingKey: string;

  constructor(
    private readonly transport: Transport,
    readonly id: string,
    historyLength?: number,
    routingKey?: string,
  ) {
    this.historyLength = historyLength;
    this.routingKey = routingKey ?? id;
  }

  /** Append token ids to the history (they are prefilled by the next generation). Returns the history length. */
  async append(ids: Iterable<number>, options: CallOptions = {}): Promise<number> {
    const request = { sessionId: this.id, tokenIds: tokenIds(ids, "ids") };
    const response = await this.transport.unary(this.transport.stub.appendTokens, request, options, this.routingKey);
    this.historyLength = count(response.historyLength);
    return this.historyLength;
  }

  /**
   * Generate token ids; the RPC starts when iteration starts. Each streamed token is already part of the history.
   * `maxTokens` outside 1..the server's limit throws `InvalidArgumentError` at once (the limit is known after
   * `client.createSession()` or `client.modelInfo()`).
   * Leaving the `for await` loop early, aborting `options.signal` or calling `cancel()` on the stream cancels it.
   */
  generate(options: GenerateOptions): TokenStream {
    const command = generateCommand(options, this.transport.modelInfo?.limits.maxGenerateTokens);
    this.lastStats = undefined;
    return new TokenStream(() => this.openGenerate(command), {
      signal: options.signal,
      interTokenTimeoutMs: options.interTokenTimeoutMs,
      timeoutMs: options.timeoutMs,
      onStats: (stats) => {
        this.lastStats = stats;
      },
    });
  }

  /** Open a `Converse` stream bound to this session (one long-lived bidirectional RPC). */
  converse(options: { signal?: AbortSignal } = {}): Promise<Conversation> {
    return Conversation.open(this.transport, this.id, options, this.routingKey);
  }

  /**
   * Branch the session: a new session whose history is this one's (its first `prefixTokens` tokens when given) and
   * whose KV cache starts as a copy of this one's, so the branch costs no prefill. The two are independent
   * afterwards; a fork of a generating session waits for the generation to end.
   */
  async fork(options: ForkOptions = {}): Promise<Session> {
    const request = forkRequest(this.id, options);
    const response = await this.transport.unary(this.transport.stub.forkSession, request, options, this.routingKey);
    return new Session(this.transport, response.sessionId, count(response.historyLength), this.routingKey);
  }

  /** Describe the session; `historyTailTokens` also returns that many trailing history tokens. */
  async info(options: SessionInfoOptions = {}): Promise<SessionInfo> {
    const request = { sessionId: this.id, historyTailTokens: historyTailTokens(options.historyTailTokens) };
    const response = await this.transport.unary(this.transport.stub.getSessionInfo, request, options, this.routingKey);
    return sessionInfo(response);
  }

  /** Close the session and free its memory on the server (a running generation is cancelled). Returns the final
   * history length. Idempotent: closing again returns the same length without a call. */
  async close(options: CallOptions = {}): Promise<number> {
    if (this.finalHistoryLength !== undefined) return this.finalHistoryLength;
    const response = await this.transport.unary(
      this.transport.stub.closeSession,
      { sessionId: this.id },
      options,
      this.routingKey,
    );
    this.historyLength = count(response.finalHistoryLength);
    this.finalHistoryLength = this.historyLength;
    return this.historyLength;
  }

  private openGenerate(command: ReturnType<typeof generateCommand>): GenerationSource {
    const transport = this.transport;
    transport.checkOpen();
    const call = transport.stub.generate({ sessionId: this.id, ...command }, transport.metadata(this.routingKey), {});
    const release = transport.track(call);
    const events = new EventQueue<GenerationEvent>();
    events.onDrain = () => call.resume();
    call.on("data", (response: GenerateResponse) => {
      const event = generateEvent(response);
      if (event !== undefined && !events.push(event)) call.pause();
    });
    call.on("error", (error: Error) => {
      release();
      events.fail(fromGrpcError(error));
    });
    call.on("end", () => {
      release();
      events.end();
    });
    return { events, cancel: () => call.cancel() };
  }
}
