import { type ChannelCredentials, type ChannelOptions, credentials } from "@grpc/grpc-js";
import { count, createSessionRequest, milliseconds, modelInfo } from "./convert.js";
import { KakeyaError, UnavailableError } from "./errors.js";
import { RuntimeServiceClient } from "./generated/kakeya/v1/runtime.js";
import { Session } from "./session.js";
import { routingKey, Transport } from "./transport.js";
import type { CallOptions, CreateSessionOptions, ModelInfo } from "./types.js";

/** TLS settings; `true` uses the system's root certificates. */
export interface TlsOptions {
  /** PEM root certificates that sign the server's certificate (for a self-signed server). */
  rootCerts?: Buffer | string;
  /** PEM client key and certificate chain, for servers that require client certificates. */
  privateKey?: Buffer | string;
  certChain?: Buffer | string;
}

export interface ClientOptions {
  /** Sent as `authorization: Bearer <apiKey>` on every call (servers started with `--api-key` require it). */
  apiKey?: string;
  /** Connect over TLS; unset or `false` connects in plaintext. */
  tls?: boolean | TlsOptions;
  /** Default deadline of unary calls (create, append, info, close) in milliseconds; unset means none.
   * Each call's own `timeoutMs` overrides it. Generations take their deadlines per call. */
  timeoutMs?: number;
  /** Extra gRPC channel options, e.g. `{ "grpc.max_receive_message_length": 32 << 20 }`. */
  channelOptions?: ChannelOptions;
  /** Use this generated gRPC client instead of creating one for `address` (its channel is closed by `close()`). */
  grpcClient?: RuntimeServiceClient;
}

function buffer(value: Buffer | string | undefined): Buffer | null {
  if (value === undefined) return null;
  return typeof value === "string" ? Buffer.from(value) : value;
}

function channelCredentials(tls: ClientOptions["tls"]): ChannelCredentials {
  if (tls === undefined || tls === false) return credentials.createInsecure();
  if (tls === true) return credentials.createSsl();
  return credentials.createSsl(buffer(tls.rootCerts), buffer(tls.privateKey), buffer(tls.certChain));
}

/**
 * A connection to a Kakeya runtime (`kakeya.v1.RuntimeService`), e.g. `new Client("127.0.0.1:50051")`.
 *
 * The channel connects lazily on the first call. `close()` cancels every call still running (generations and
 * conversations included) and closes the channel.
 */
export class Client {
  readonly address: string;
  private readonly transport: Transport;

  constructor(address: string, options: ClientOptions = {}) {
    if (typeof address !== "string" || address === "") {
      throw new KakeyaError("the address must be a non-empty host:port string");
    }
    this.address = address;
    const timeoutMs = milliseconds(options.timeoutMs, "timeoutMs");
    const stub =
      options.grpcClient ??
      new RuntimeServiceClient(address, channelCredentials(options.tls), options.channelOptions ?? {});
    this.transport = new Transport(stub, options.apiKey, timeoutMs);
  }

  /** The served model's facts (vocabulary size, end-of-sequence ids, trained context length, chat template) and
   * the server's defaults and limits. Asked once per client, then remembered. */
  async modelInfo(options: CallOptions = {}): Promise<ModelInfo> {
    if (this.transport.modelInfo === undefined) {
      const response = await this.transport.unary(this.transport.stub.getModelInfo, {}, options);
      this.transport.modelInfo = modelInfo(response);
    }
    return this.transport.modelInfo;
  }

  /** Create a session; `initialTokens` become its history. Without `eosTokenIds` its generations stop on the
   * model's end-of-sequence ids. */
  async createSession(options: CreateSessionOptions = {}): Promise<Session> {
    const request = createSessionRequest(options);
    await this.modelInfo(options); // the limits generate() checks maxTokens against
    const key = routingKey(options.routingKey);
    const response = await this.transport.unary(this.transport.stub.createSession, request, options, key);
    return new Session(this.transport, response.sessionId, count(response.historyLength), key);
  }

  /** A handle on an existing session id (no call is made; a wrong id fails on first use with
   * `SessionNotFoundError`). Behind a proxy, pass the session's `routingKey` to keep its calls on the daemon that
   * holds it; without one the session id is the key. */
  session(sessionId: string, options: { routingKey?: string } = {}): Session {
    return new Session(this.transport, sessionId, undefined, routingKey(options.routingKey, sessionId));
  }

  /** Wait until the channel is connected, up to `timeoutMs` (default 10 s). */
  ready(options: { timeoutMs?: number } = {}): Promise<void> {
    this.transport.checkOpen();
    const ms = milliseconds(options.timeoutMs, "timeoutMs") ?? 10_000;
    return new Promise<void>((resolve, reject) => {
      this.transport.stub.waitForReady(new Date(Date.now() + ms), (error) => {
        if (error === undefined || error === null) resolve();
        else
          reject(
            new UnavailableError(`no connection to ${this.address} within ${ms} ms: ${error.message}`, {
              cause: error,
            }),
          );
      });
    });
  }

  /** Cancel every running call and close the channel. */
  close(): void {
    this.transport.close();
  }
}
