import { status } from "@grpc/grpc-js";
import { milliseconds, generationStats } from "./convert.js";
import {
  CancelledError,
  DeadlineExceededError,
  InterTokenTimeoutError,
  KakeyaError,
  UnavailableError,
} from "./errors.js";
import type { GenerateDone } from "./generated/kakeya/v1/runtime.js";
import type { EventQueue } from "./queue.js";
import type { GenerationStats, TokenLogprobs } from "./types.js";

/** One event of a generation, whichever RPC carried it. */
export type GenerationEvent =
  | { kind: "token"; tokenId: number; logprobs?: TokenLogprobs }
  | { kind: "truncated"; droppedTokenCount: number }
  | { kind: "done"; done: GenerateDone };

/** A running generation on the server: its events, and how to stop it. */
export interface GenerationSource {
  readonly events: EventQueue<GenerationEvent>;
  /** Ask the server to stop the generation; safe to call more than once and after the end. */
  cancel(): void;
}

export interface TokenStreamOptions {
  signal?: AbortSignal | undefined;
  interTokenTimeoutMs?: number | undefined;
  timeoutMs?: number | undefined;
  /** Receives the statistics when the server's final message arrives. */
  onStats?: ((stats: GenerationStats) => void) | undefined;
}

const DEADLINE = { code: status.DEADLINE_EXCEEDED };

function abortError(signal: AbortSignal): CancelledError {
  return new CancelledError("the generation was cancelled by its AbortSignal", {
    code: status.CANCELLED,
    cause: signal.reason,
  });
}

/**
 * The token ids of one generation, as an `AsyncIterable<number>` that can be iterated once.
 *
 * Leaving the `for await` loop early, aborting the signal, or `cancel()` stops the generation on the server.
 * Tokens streamed before the stop are part of the session's history. After a complete iteration `stats` holds
 * the server's statistics.
 */
export class TokenStream implements AsyncIterable<number> {
  /** The server's statistics, once the generation has ended normally. */
  stats: GenerationStats | undefined;
  /** Log-probabilities of the tokens streamed so far, one per token (empty unless `logprobs` was asked for). */
  readonly logprobs: TokenLogprobs[] = [];
  private source: GenerationSource | undefined;
  private iterated = false;
  private cancelled = false;
  private interruptRun: ((error: KakeyaError) => void) | undefined;
  private readonly interTokenTimeoutMs: number | undefined;
  private readonly timeoutMs: number | undefined;

  /** `open` starts the generation (or hands over one already started); it is called when iteration starts, and
   * the whole-generation deadline `timeoutMs` counts from then. */
  constructor(
    private readonly open: () => GenerationSource,
    private readonly options: TokenStreamOptions = {},
  ) {
    this.interTokenTimeoutMs = milliseconds(options.interTokenTimeoutMs, "interTokenTimeoutMs");
    this.timeoutMs = milliseconds(options.timeoutMs, "timeoutMs");
  }

  [Symbol.asyncIterator](): AsyncIterator<number> {
    if (this.iterated) throw new KakeyaError("a TokenStream can be iterated only once");
    this.iterated = true;
    return this.run();
  }

  /** Stop the generation. A later or running iteration throws `CancelledError`. */
  cancel(): void {
    this.cancelled = true;
    this.interruptRun?.(new CancelledError("the generation was cancelled", { code: status.CANCELLED }));
    this.source?.cancel();
  }

  /** Iterate to the end and return every token id. */
  async toArray(): Promise<number[]> {
    const tokens: number[] = [];
    for await (const token of this) tokens.push(token);
    return tokens;
  }

  private async *run(): AsyncGenerator<number, void, undefined> {
    const { signal } = this.options;
    let finished = false;
    let droppedTokenCount = 0;
    let rejectInterrupt: (error: KakeyaError) => void = () => {};
    // Rejects when the signal aborts or the whole-generation deadline passes; every wait races against it.
    const interrupt = new Promise<never>((_, reject) => {
      rejectInterrupt = reject;
    });
    interrupt.catch(() => {});
    // The interrupt is rejected before the source is cancelled, so a waiting iteration reports this error
    // rather than whatever the cancelled source produces next.
    const stop = (error: KakeyaError): void => {
      rejectInterrupt(error);
      this.source?.cancel();
    };
    this.interruptRun = rejectInterrupt;
    const onAbort = (): void => stop(abortError(signal as AbortSignal));
    const deadlineMs = this.timeoutMs;
    const onDeadline = (): void =>
      stop(new DeadlineExceededError(`the generation ran past its ${deadlineMs} ms deadline`, DEADLINE));
    const deadline = deadlineMs === undefined ? undefined : setTimeout(onDeadline, deadlineMs);
    try {
      if (signal?.aborted) throw abortError(signal);
      if (this.cancelled) throw new CancelledError("the generation was cancelled", { code: status.CANCELLED });
      signal?.addEventListener("abort", onAbort, { once: true });
      this.source = this.open();
      for (;;) {
        const result = await this.nextEvent(this.source, interrupt);
        if (result.done) throw new UnavailableError("the generation stream ended before its final message");
        const event = result.value;
        if (event.kind === "token") {
          if (event.logprobs !== undefined) this.logprobs.push(event.logprobs);
          yield event.tokenId;
        } else if (event.kind === "truncated") {
          droppedTokenCount = event.droppedTokenCount;
        } else {
          finished = true;
          this.stats = generationStats(event.done, droppedTokenCount);
          this.options.onStats?.(this.stats);
          return;
        }
      }
    } finally {
      signal?.removeEventListener("abort", onAbort);
      if (deadline !== undefined) clearTimeout(deadline);
      this.interruptRun = undefined;
      if (!finished) this.source?.cancel();
    }
  }

  private nextEvent(source: GenerationSource, interrupt: Promise<never>): Promise<IteratorResult<GenerationEvent>> {
    const pending = source.events.next();
    const waitMs = this.interTokenTimeoutMs;
    if (waitMs === undefined) return Promise.race([interrupt, pending]);
    let timer: NodeJS.Timeout | undefined;
    const timeout = new Promise<never>((_, reject) => {
      timer = setTimeout(() => {
        reject(new InterTokenTimeoutError(`no token arrived within ${waitMs} ms`, DEADLINE));
        source.cancel();
      }, waitMs);
    });
    return Promise.race([interrupt, pending, timeout]).finally(() => clearTimeout(timer));
  }
}
