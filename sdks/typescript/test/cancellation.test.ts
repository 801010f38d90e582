import { afterAll, describe, expect, it } from "vitest";
import {
  CancelledError,
  type Client,
  DeadlineExceededError,
  InterTokenTimeoutError,
  type Session,
  type TokenStream,
} from "../src/index.js";
import { PROMPT, eventually, sharedClient } from "./support/fixtures.js";

// Far more tokens than any test waits for: a generation still running when the test cancels it.
const LONG = 8192;

const client = sharedClient();
afterAll(() => client.close());

async function idle(session: Session): Promise<void> {
  await eventually(async () => !(await session.info()).generating);
}

/** Start a long generation and wait for its first token; returns the open iterator. */
async function running(
  session: Session,
): Promise<{ stream: TokenStream; iterator: AsyncIterator<number>; first: number }> {
  const stream = session.generate({ maxTokens: LONG });
  const iterator = stream[Symbol.asyncIterator]();
  const first = await iterator.next();
  expect(first.done).toBe(false);
  return { stream, iterator, first: first.value as number };
}

describe("cancellation", () => {
  it("aborting the signal mid-stream throws CancelledError and stops the generation on the server", async () => {
    const session = await client.createSession({ initialTokens: PROMPT });
    const controller = new AbortController();
    const received: number[] = [];
    const consume = async (): Promise<void> => {
      for await (const token of session.generate({ maxTokens: LONG, signal: controller.signal })) {
        received.push(token);
        if (received.length === 3) controller.abort();
      }
    };
    await expect(consume()).rejects.toBeInstanceOf(CancelledError);
    expect(received).toHaveLength(3);

    await idle(session);
    const generated = (await session.info()).historyLength - PROMPT.length;
    expect(generated).toBeGreaterThanOrEqual(3);
    expect(generated).toBeLessThan(LONG);
    // Every token the client saw entered the history, in order.
    const { historyTail } = await session.info({ historyTailTokens: generated });
    expect(historyTail.slice(0, 3)).toEqual(received);
    expect(session.lastStats).toBeUndefined();
    await session.close();
  });

  it("a signal aborted before iteration starts makes no call", async () => {
    const session = await client.createSession({ initialTokens: PROMPT });
    const controller = new AbortController();
    controller.abort(new Error("not needed any more"));
    const stream = session.generate({ maxTokens: 4, signal: controller.signal });
    const error = await stream.toArray().catch((e: unknown) => e);
    expect(error).toBeInstanceOf(CancelledError);
    expect((error as CancelledError).cause).toEqual(new Error("not needed any more"));
    expect((await session.info()).historyLength).toBe(PROMPT.length);
    await session.close();
  });

  it("breaking out of the for-await loop cancels the generation on the server", async () => {
    const session = await client.createSession({ initialTokens: PROMPT });
    const received: number[] = [];
    for await (const token of session.generate({ maxTokens: LONG })) {
      received.push(token);
      if (received.length === 2) break;
    }
    await idle(session);
    const generated = (await session.info()).historyLength - PROMPT.length;
    expect(generated).toBeGreaterThanOrEqual(2);
    expect(generated).toBeLessThan(LONG);
    // The session takes the next turn normally.
    expect(await session.append([1])).toBe(PROMPT.length + generated + 1);
    await session.close();
  });

  it("stream.cancel() stops a running iteration with CancelledError", async () => {
    const session = await client.createSession({ initialTokens: PROMPT });
    const { stream, iterator } = await running(session);
    stream.cancel();
    await expect(iterator.next()).rejects.toBeInstanceOf(CancelledError);
    await idle(session);
    expect((await session.info()).historyLength).toBeLessThan(PROMPT.length + LONG);
    await session.close();
  });

  it("closing the session ends its running generation with stop reason cancelled", async () => {
    const session = await client.createSession({ initialTokens: PROMPT });
    const { stream, iterator } = await running(session);
    const finalLength = await session.close();
    expect(finalLength).toBeLessThan(PROMPT.length + LONG);
    let result = await iterator.next();
    while (!result.done) result = await iterator.next();
    expect(stream.stats?.stopReason).toBe("cancelled");
    expect(stream.stats?.generatedTokenCount).toBe(finalLength - PROMPT.length);
  });

  it("an inter-token timeout cancels a generation that waits too long and throws InterTokenTimeoutError", async () => {
    const session = await client.createSession({ initialTokens: PROMPT });
    const blocker = await running(session);
    // A second generation on the same session waits its turn behind the first one.
    const queued = session.generate({ maxTokens: 4, interTokenTimeoutMs: 300 });
    const error = await queued.toArray().catch((e: unknown) => e);
    expect(error).toBeInstanceOf(InterTokenTimeoutError);
    expect(error).toBeInstanceOf(DeadlineExceededError);
    blocker.stream.cancel();
    await idle(session);
    await session.close();
  });

  it("a generation deadline cancels the generation with DeadlineExceededError", async () => {
    const session = await client.createSession({ initialTokens: PROMPT });
    const blocker = await running(session);
    const error = await session
      .generate({ maxTokens: 4, timeoutMs: 300 })
      .toArray()
      .catch((e: unknown) => e);
    expect(error).toBeInstanceOf(DeadlineExceededError);
    expect(error).not.toBeInstanceOf(InterTokenTimeoutError);
    blocker.stream.cancel();
    await idle(session);
    await session.close();
  });

  it("a unary call past its deadline fails with DeadlineExceededError", async () => {
    const session = await client.createSession({ initialTokens: PROMPT });
    const blocker = await running(session);
    // An append waits for the session's running generation, longer than its deadline.
    const error = await session.append([1], { timeoutMs: 300 }).catch((e: unknown) => e);
    expect(error).toBeInstanceOf(DeadlineExceededError);
    expect((error as DeadlineExceededError).code).toBe(4);
    blocker.stream.cancel();
    await idle(session);
    await session.close();
  });

  it("the client's default deadline applies to unary calls", async () => {
    const impatient = sharedClient({ timeoutMs: 300 });
    const session = await client.createSession({ initialTokens: PROMPT });
    const blocker = await running(session);
    await expect(impatient.session(session.id).append([1])).rejects.toBeInstanceOf(DeadlineExceededError);
    blocker.stream.cancel();
    impatient.close();
    await idle(session);
    await session.close();
  });

  it("aborting a unary call's signal rejects it with CancelledError", async () => {
    const session = await client.createSession({ initialTokens: PROMPT });
    const blocker = await running(session);
    const controller = new AbortController();
    const pending = session.append([1], { signal: controller.signal });
    setTimeout(() => controller.abort(), 100);
    await expect(pending).rejects.toBeInstanceOf(CancelledError);
    blocker.stream.cancel();
    await idle(session);
    await session.close();
  });

  it("client.close() cancels the generations still running on it", async () => {
    const own: Client = sharedClient();
    const session = await own.createSession({ initialTokens: PROMPT });
    const { iterator } = await running(session);
    own.close();
    await expect(iterator.next()).rejects.toBeInstanceOf(CancelledError);
    const observer = client.session(session.id);
    await eventually(async () => !(await observer.info()).generating);
    await observer.close();
  });
});
