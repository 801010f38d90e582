import { status, type ClientDuplexStream } from "@grpc/grpc-js";
import { count, generateCommand, tokenIds, tokenLogprobs } from "./convert.js";
import { CancelledError, fromGrpcError, KakeyaError, UnavailableError } from "./errors.js";
import type { ConverseRequest, ConverseResponse } from "./generated/kakeya/v1/runtime.js";
import { EventQueue } from "./queue.js";
import { type GenerationEvent, TokenStream } from "./stream.js";
import type { Transport } from "./transport.js";
import type { GenerateOptions, GenerationStats } from "./types.js";

type Command = NonNullable<ConverseRequest["command"]>;

interface Deferred {
  resolve: (historyLength: number) => void;
  reject: (error: unknown) => void;
}

/** The options of a generation on a conversation: those of `Session.generate` without a per-call deadline. */
export type ConverseGenerateOptions = Omit<GenerateOptions, "timeoutMs">;

/**
 * One `Converse` stream bound to a session: commands are sent at once and run on the server in the order they
 * were issued, so `append` and `generate` can be pipelined.
 *
 * A server error (for example an invalid token in an append) ends the whole stream: every pending command fails
 * with that error, and so does every later call. `close()` ends the stream after the pending commands finish;
 * `abort()` cancels it at once.
 */
export class Conversation {
  /** History length after the last bind or append the server confirmed. */
  historyLength = 0;
  /** Statistics of the last generation on this conversation that ended with the server's final message. */
  lastStats: GenerationStats | undefined;
  private nextCommandId = 1n;
  private readonly replies = new Map<bigint, Deferred>();
  private readonly generations = new Map<bigint, EventQueue<GenerationEvent>>();
  private failure: KakeyaError | undefined;
  private halfClosed = false;
  private readonly finished: Promise<void>;

  private constructor(
    private readonly call: ClientDuplexStream<ConverseRequest, ConverseResponse>,
    release: () => void,
    private readonly maxGenerateTokens: number | undefined,
  ) {
    this.finished = new Promise<void>((resolve) => {
      call.on("data", (response: ConverseResponse) => this.route(response));
      call.on("error", (error: Error) => {
        release();
        this.fail(fromGrpcError(error));
        resolve();
      });
      call.on("end", () => {
        release();
        this.fail(
          this.halfClosed
            ? new KakeyaError("the conversation is closed")
            : new UnavailableError("the server ended the Converse stream"),
        );
        resolve();
      });
    });
  }

  /** Open a stream and bind it to `sessionId`; resolves once the server confirmed the binding. */
  static async open(
    transport: Transport,
    sessionId: string,
    options: { signal?: AbortSignal },
    routingKey?: string,
  ): Promise<Conversation> {
    transport.checkOpen();
    const { signal } = options;
    if (signal?.aborted) {
      throw new CancelledError("the conversation was cancelled by its AbortSignal", { cause: signal.reason });
    }
    const call = transport.stub.converse(transport.metadata(routingKey), {});
    const limit = transport.modelInfo?.limits.maxGenerateTokens;
    const conversation = new Conversation(call, transport.track(call), limit);
    if (signal !== undefined) {
      const onAbort = (): void => conversation.abort();
      signal.addEventListener("abort", onAbort, { once: true });
      void conversation.finished.then(() => signal.removeEventListener("abort", onAbort));
    }
    conversation.historyLength = await conversation.command({ $case: "bind", value: { sessionId } });
    return conversation;
  }

  /** Append token ids to the session's history; resolves with the history length once the server ran it. */
  async append(ids: Iterable<number>): Promise<number> {
    const historyLength = await this.command({ $case: "append", value: { tokenIds: tokenIds(ids, "ids") } });
    this.historyLength = historyLength;
    return historyLength;
  }

  /**
   * Send a generate command now and return its tokens. Leaving the loop early or aborting the signal sends a
   * cancel command, which stops every generation commanded on this stream so far.
   */
  generate(options: ConverseGenerateOptions): TokenStream {
    const command = generateCommand(options, this.maxGenerateTokens);
    const events = new EventQueue<GenerationEvent>(Number.POSITIVE_INFINITY);
    const id = this.send({ $case: "generate", value: command });
    this.generations.set(id, events);
    let cancelSent = false;
    const source = {
      events,
      cancel: () => {
        if (cancelSent || events.closed) return;
        cancelSent = true;
        this.cancel();
      },
    };
    this.lastStats = undefined;
    return new TokenStream(() => source, {
      signal: options.signal,
      interTokenTimeoutMs: options.interTokenTimeoutMs,
      onStats: (stats) => {
        this.lastStats = stats;
      },
    });
  }

  /** Stop every generation commanded so far; each ends normally with stop reason `cancelled`. */
  cancel(): void {
    if (this.failure === undefined && !this.halfClosed) this.send({ $case: "cancel", value: {} });
  }

  /** Finish the stream: no more commands; resolves when the server has run the pending ones and ended it. */
  async close(): Promise<void> {
    if (!this.halfClosed && this.failure === undefined) {
      this.halfClosed = true;
      this.call.end();
    }
    await this.finished;
  }

  /** Cancel the stream at once; pending commands fail with `CancelledError`. */
  abort(): void {
    this.fail(new CancelledError("the conversation was aborted", { code: status.CANCELLED }));
    this.call.cancel();
  }

  private command(command: Command): Promise<number> {
    return new Promise<number>((resolve, reject) => {
      const id = this.send(command);
      this.replies.set(id, { resolve, reject });
    });
  }

  private send(command: Command): bigint {
    if (this.failure !== undefined) throw this.failure;
    if (this.halfClosed) throw new KakeyaError("the conversation is closed");
    const commandId = this.nextCommandId++;
    this.call.write({ commandId, command });
    return commandId;
  }

  private route(response: ConverseResponse): void {
    const id = response.commandId;
    const event = response.event;
    switch (event?.$case) {
      case "bound":
      case "appended":
        this.replies.get(id)?.resolve(count(event.value.historyLength));
        this.replies.delete(id);
        return;
      case "tokenId":
        this.generations.get(id)?.push({ kind: "token", tokenId: event.value });
        return;
      case "scoredToken":
        this.generations
          .get(id)
          ?.push({ kind: "token", tokenId: event.value.tokenId, logprobs: tokenLogprobs(event.value) });
        return;
      case "truncated":
        this.generations.get(id)?.push({ kind: "truncated", droppedTokenCount: count(event.value.droppedTokenCount) });
        return;
      case "done": {
        const events = this.generations.get(id);
        this.generations.delete(id);
        events?.push({ kind: "done", done: event.value });
        events?.end();
        return;
      }
      default:
        return;
    }
  }

  private fail(error: KakeyaError): void {
    this.failure ??= error;
    for (const reply of this.replies.values()) reply.reject(this.failure);
    this.replies.clear();
    for (const events of this.generations.values()) events.fail(this.failure);
    this.generations.clear();
  }
}
