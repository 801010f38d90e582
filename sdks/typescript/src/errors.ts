import { status, type ServiceError } from "@grpc/grpc-js";

/** Every error the SDK raises: a gRPC status (when the server or the transport produced one) and a message. */
export class KakeyaError extends Error {
  /** The gRPC status code, or `undefined` for errors raised before any call was made. */
  readonly code: status | undefined;
  /** The status code's name, e.g. `"NOT_FOUND"`, or `undefined` with `code`. */
  readonly status: string | undefined;
  /** The server's `x-request-id` for the failed call, when it sent one. */
  readonly requestId: string | undefined;

  constructor(message: string, options: { code?: status; requestId?: string | undefined; cause?: unknown } = {}) {
    super(message, options.cause === undefined ? undefined : { cause: options.cause });
    this.name = new.target.name;
    this.code = options.code;
    this.status = options.code === undefined ? undefined : status[options.code];
    this.requestId = options.requestId;
  }
}

/** Malformed input: a token id outside the vocabulary, `maxTokens` out of range, a bad sampling parameter. */
export class InvalidArgumentError extends KakeyaError {}

/** The session id is unknown, closed or evicted. */
export class SessionNotFoundError extends KakeyaError {}

/** A cache invariant broke on the server; the session was failed and freed. */
export class SessionFailedError extends KakeyaError {}

/** A server limit was reached: sessions, history length, tokens per append, KV budget, queue deadline. */
export class ResourceExhaustedError extends KakeyaError {}

/** The API key is missing or wrong. */
export class UnauthenticatedError extends KakeyaError {}

/** The server cannot be reached or is shutting down. */
export class UnavailableError extends KakeyaError {}

/** The call's deadline passed before it completed. */
export class DeadlineExceededError extends KakeyaError {}

/** No token arrived within the generation's `interTokenTimeoutMs`; the generation was cancelled. */
export class InterTokenTimeoutError extends DeadlineExceededError {}

/** The call was cancelled by the caller (an aborted `AbortSignal`, or the client was closed). */
export class CancelledError extends KakeyaError {}

const BY_STATUS = new Map<status, typeof KakeyaError>([
  [status.INVALID_ARGUMENT, InvalidArgumentError],
  [status.NOT_FOUND, SessionNotFoundError],
  [status.FAILED_PRECONDITION, SessionFailedError],
  [status.RESOURCE_EXHAUSTED, ResourceExhaustedError],
  [status.UNAUTHENTICATED, UnauthenticatedError],
  [status.UNAVAILABLE, UnavailableError],
  [status.DEADLINE_EXCEEDED, DeadlineExceededError],
  [status.CANCELLED, CancelledError],
]);

function isServiceError(error: unknown): error is ServiceError {
  return error instanceof Error && typeof (error as Partial<ServiceError>).code === "number";
}

/** The typed SDK error for a failed gRPC call (status code -> class); other errors are wrapped in `KakeyaError`. */
export function fromGrpcError(error: unknown): KakeyaError {
  if (error instanceof KakeyaError) return error;
  if (!isServiceError(error)) {
    return new KakeyaError(error instanceof Error ? error.message : String(error), { cause: error });
  }
  const rid = error.metadata?.get("x-request-id")[0];
  const requestId = typeof rid === "string" ? rid : undefined;
  const ErrorClass = BY_STATUS.get(error.code) ?? KakeyaError;
  const message = error.details || error.message;
  return new ErrorClass(message, { code: error.code, requestId, cause: error });
}
