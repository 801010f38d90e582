import { Metadata, status, type CallOptions as GrpcCallOptions, type ServiceError } from "@grpc/grpc-js";
import { randomBytes } from "node:crypto";
import { milliseconds } from "./convert.js";
import { CancelledError, fromGrpcError, InvalidArgumentError, KakeyaError } from "./errors.js";
import type { RuntimeServiceClient } from "./generated/kakeya/v1/runtime.js";
import type { CallOptions, ModelInfo } from "./types.js";

/**
 * The metadata key every call of a session carries its routing key in: a proxy in front of several daemons hashes on
 * it so that all calls of a session reach the daemon holding its KV cache (docs/scale-out.md).
 */
export const ROUTING_KEY_HEADER = "x-kakeya-routing-key";

/** `key` checked, or `fallback`, or a fresh random key (128 bits). */
export function routingKey(key: string | undefined, fallback?: string): string {
  if (key === undefined) return fallback ?? randomBytes(16).toString("base64url");
  if (typeof key !== "string" || key.length === 0 || !/^[\x20-\x7e]+$/.test(key)) {
    throw new InvalidArgumentError(`routingKey must be a non-empty printable ASCII string, got ${JSON.stringify(key)}`);
  }
  return key;
}

/** Anything that can be cancelled: the calls a transport tracks so that `close()` can end them. */
interface Cancellable {
  cancel(): void;
}

type UnaryMethod<Req, Res> = (
  request: Req,
  metadata: Metadata,
  options: Partial<GrpcCallOptions>,
  callback: (error: ServiceError | null, response: Res) => void,
) => Cancellable;

/**
 * The generated gRPC client plus what every call needs: credentials in metadata, deadlines, cancellation by
 * `AbortSignal`, status -> typed error mapping, and a registry of live calls for explicit teardown.
 */
export class Transport {
  private readonly live = new Set<Cancellable>();
  private closed = false;
  /** The server's model facts and limits, once asked (`Client.modelInfo()`); generations check `maxTokens`
   * against its limit. */
  modelInfo: ModelInfo | undefined;

  constructor(
    readonly stub: RuntimeServiceClient,
    private readonly apiKey: string | undefined,
    private readonly defaultTimeoutMs: number | undefined,
  ) {}

  /** Call metadata: the API key, and the session's routing key when the call belongs to a session. */
  metadata(routingKey?: string): Metadata {
    const metadata = new Metadata();
    if (this.apiKey) metadata.set("authorization", `Bearer ${this.apiKey}`);
    if (routingKey !== undefined) metadata.set(ROUTING_KEY_HEADER, routingKey);
    return metadata;
  }

  /** gRPC call options with the deadline `timeoutMs` from now (unset: no deadline). */
  callOptions(timeoutMs: number | undefined): Partial<GrpcCallOptions> {
    const ms = milliseconds(timeoutMs, "timeoutMs");
    return ms === undefined ? {} : { deadline: new Date(Date.now() + ms) };
  }

  checkOpen(): void {
    if (this.closed) throw new KakeyaError("the client is closed");
  }

  /** Run a unary call as a promise under the call's (or the client's default) deadline. */
  unary<Req, Res>(
    method: UnaryMethod<Req, Res>,
    request: Req,
    options: CallOptions = {},
    routingKey?: string,
  ): Promise<Res> {
    this.checkOpen();
    const { signal } = options;
    const callOptions = this.callOptions(options.timeoutMs ?? this.defaultTimeoutMs);
    if (signal?.aborted) return Promise.reject(cancelledBy(signal));
    return new Promise<Res>((resolve, reject) => {
      const onAbort = (): void => call.cancel();
      const call = method.call(this.stub, request, this.metadata(routingKey), callOptions, (error, response) => {
        this.live.delete(call);
        signal?.removeEventListener("abort", onAbort);
        if (error === null) resolve(response);
        else if (signal?.aborted && error.code === status.CANCELLED) reject(cancelledBy(signal));
        else reject(fromGrpcError(error));
      });
      this.live.add(call);
      signal?.addEventListener("abort", onAbort, { once: true });
    });
  }

  /** Track a streaming call until `release`; `close()` cancels whatever is still tracked. */
  track(call: Cancellable): () => void {
    this.live.add(call);
    return () => this.live.delete(call);
  }

  /** Cancel every live call and close the channel. */
  close(): void {
    if (this.closed) return;
    this.closed = true;
    for (const call of [...this.live]) call.cancel();
    this.live.clear();
    this.stub.close();
  }
}

function cancelledBy(signal: AbortSignal): CancelledError {
  return new CancelledError("the call was cancelled by its AbortSignal", {
    code: status.CANCELLED,
    cause: signal.reason,
  });
}
