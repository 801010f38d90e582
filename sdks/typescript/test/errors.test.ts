import { Metadata, type ServiceError, status } from "@grpc/grpc-js";
import { afterAll, describe, expect, it } from "vitest";
import { fromGrpcError } from "../src/errors.js";
import {
  CancelledError,
  Client,
  DeadlineExceededError,
  InvalidArgumentError,
  KakeyaError,
  ResourceExhaustedError,
  SessionFailedError,
  SessionNotFoundError,
  UnauthenticatedError,
  UnavailableError,
} from "../src/index.js";
import { OUT_OF_VOCABULARY, PROMPT, sharedClient } from "./support/fixtures.js";

const client = sharedClient();
afterAll(() => client.close());

// The shared daemon's --max-append-tokens is 512.

describe("typed errors", () => {
  it("an unknown session id fails every call with SessionNotFoundError (NOT_FOUND)", async () => {
    const ghost = client.session("no-such-session");
    const calls: Array<() => Promise<unknown>> = [
      () => ghost.append([1]),
      () => ghost.info(),
      () => ghost.close(),
      () => ghost.generate({ maxTokens: 1 }).toArray(),
      () => ghost.converse(),
    ];
    for (const call of calls) {
      const error = await call().catch((e: unknown) => e);
      expect(error).toBeInstanceOf(SessionNotFoundError);
      expect(error).toBeInstanceOf(KakeyaError);
      expect((error as KakeyaError).code).toBe(status.NOT_FOUND);
      expect((error as KakeyaError).status).toBe("NOT_FOUND");
      expect((error as KakeyaError).message).toContain("no-such-session");
    }
  });

  it("a closed session is unknown afterwards", async () => {
    const session = await client.createSession({ initialTokens: PROMPT });
    await session.close();
    await expect(session.append([1])).rejects.toBeInstanceOf(SessionNotFoundError);
  });

  it("a token id outside the vocabulary fails with InvalidArgumentError and leaves the session untouched", async () => {
    const session = await client.createSession({ initialTokens: PROMPT });
    const error = await session.append([5, OUT_OF_VOCABULARY]).catch((e: unknown) => e);
    expect(error).toBeInstanceOf(InvalidArgumentError);
    expect((error as KakeyaError).code).toBe(status.INVALID_ARGUMENT);
    expect((error as KakeyaError).message).toContain(String(OUT_OF_VOCABULARY));
    expect((error as KakeyaError).requestId).toMatch(/^[0-9a-f]{16}$/);
    expect((await session.info()).historyLength).toBe(PROMPT.length);

    await expect(client.createSession({ initialTokens: [OUT_OF_VOCABULARY] })).rejects.toBeInstanceOf(
      InvalidArgumentError,
    );
    await expect(client.createSession({ eosTokenIds: [OUT_OF_VOCABULARY] })).rejects.toBeInstanceOf(
      InvalidArgumentError,
    );
    await expect(
      session.generate({ maxTokens: 2, stopTokenIds: [OUT_OF_VOCABULARY] }).toArray(),
    ).rejects.toBeInstanceOf(InvalidArgumentError);
    await session.close();
  });

  it("out-of-range generation parameters fail with InvalidArgumentError from the server", async () => {
    const session = await client.createSession({ initialTokens: PROMPT });
    const bad = [
      { maxTokens: 2, temperature: -1 },
      { maxTokens: 2, topP: 1.5 },
    ];
    for (const options of bad) {
      await expect(session.generate(options).toArray()).rejects.toBeInstanceOf(InvalidArgumentError);
    }
    expect((await session.info()).historyLength).toBe(PROMPT.length);
    await session.close();
  });

  it("values the wire cannot carry are rejected before any call", async () => {
    const session = client.session("never-contacted");
    expect(() => session.generate({ maxTokens: 1.5 })).toThrow(InvalidArgumentError);
    expect(() => session.generate({ maxTokens: 2, seed: -1 })).toThrow(InvalidArgumentError);
    expect(() => session.generate({ maxTokens: 2, seed: 1n << 64n })).toThrow(InvalidArgumentError);
    expect(() => session.generate({ maxTokens: 2, interTokenTimeoutMs: Number.NaN })).toThrow(InvalidArgumentError);
    await expect(session.append([-1])).rejects.toBeInstanceOf(InvalidArgumentError);
    await expect(session.append([2 ** 32])).rejects.toBeInstanceOf(InvalidArgumentError);
    await expect(session.append("abc" as unknown as number[])).rejects.toBeInstanceOf(InvalidArgumentError);
    const error = await session.append([0.5]).catch((e: unknown) => e);
    expect((error as KakeyaError).code).toBeUndefined();
  });

  it("an append above the server's limit fails with ResourceExhaustedError", async () => {
    const session = await client.createSession({ initialTokens: PROMPT });
    const error = await session.append(new Array<number>(513).fill(7)).catch((e: unknown) => e);
    expect(error).toBeInstanceOf(ResourceExhaustedError);
    expect((error as KakeyaError).code).toBe(status.RESOURCE_EXHAUSTED);
    expect(await session.append(new Array<number>(512).fill(7))).toBe(PROMPT.length + 512);
    await session.close();
  });

  it("a server that is not there fails with UnavailableError", async () => {
    const nowhere = new Client("127.0.0.1:1", { timeoutMs: 10_000 });
    await expect(nowhere.createSession()).rejects.toBeInstanceOf(UnavailableError);
    await expect(nowhere.ready({ timeoutMs: 200 })).rejects.toBeInstanceOf(UnavailableError);
    nowhere.close();
  });

  it("a closed client refuses new calls", async () => {
    const closed = sharedClient();
    closed.close();
    await expect(closed.createSession()).rejects.toThrow(/client is closed/);
  });

  it("maps every status code the server uses to its error class, and others to KakeyaError", () => {
    const cases: Array<[status, typeof KakeyaError]> = [
      [status.INVALID_ARGUMENT, InvalidArgumentError],
      [status.NOT_FOUND, SessionNotFoundError],
      [status.FAILED_PRECONDITION, SessionFailedError],
      [status.RESOURCE_EXHAUSTED, ResourceExhaustedError],
      [status.UNAUTHENTICATED, UnauthenticatedError],
      [status.UNAVAILABLE, UnavailableError],
      [status.DEADLINE_EXCEEDED, DeadlineExceededError],
      [status.CANCELLED, CancelledError],
      [status.INTERNAL, KakeyaError],
    ];
    for (const [code, ErrorClass] of cases) {
      const metadata = new Metadata();
      metadata.set("x-request-id", "abc123");
      const grpcError = Object.assign(new Error(`${code} raw`), {
        code,
        details: "detail text",
        metadata,
      }) as ServiceError;
      const error = fromGrpcError(grpcError);
      expect(error.constructor).toBe(ErrorClass);
      expect(error).toMatchObject({ code, message: "detail text", requestId: "abc123", name: ErrorClass.name });
      expect(error.cause).toBe(grpcError);
    }
  });
});
