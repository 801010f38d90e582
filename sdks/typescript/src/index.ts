/**
 * `@kakeya/runtime`: a Node client for the Kakeya runtime, a session-bound inference server speaking
 * `kakeya.v1` gRPC over raw token ids.
 *
 * ```ts
 * const client = new Client("127.0.0.1:50051");
 * const session = await client.createSession({ initialTokens: promptIds });
 * for await (const id of session.generate({ maxTokens: 64, seed: 1 })) process.stdout.write(`${id} `);
 * await session.close();
 * client.close();
 * ```
 */
export { Client, type ClientOptions, type TlsOptions } from "./client.js";
export { Conversation, type ConverseGenerateOptions } from "./conversation.js";
export {
  CancelledError,
  DeadlineExceededError,
  InterTokenTimeoutError,
  InvalidArgumentError,
  KakeyaError,
  ResourceExhaustedError,
  SessionFailedError,
  SessionNotFoundError,
  UnauthenticatedError,
  UnavailableError,
} from "./errors.js";
export { Session } from "./session.js";
export { ROUTING_KEY_HEADER } from "./transport.js";
export { TokenStream } from "./stream.js";
export type {
  CallOptions,
  CreateSessionOptions,
  ForkOptions,
  GenerateOptions,
  GenerationStats,
  Grammar,
  KvCompressor,
  KvStrategy,
  ModelInfo,
  SamplingOptions,
  ServerLimits,
  SessionInfo,
  SessionInfoOptions,
  StopReason,
  TokenLogprobs,
} from "./types.js";
/** The generated protocol messages and gRPC client, for callers that need the raw wire types. */
export * as wire from "./generated/kakeya/v1/runtime.js";
