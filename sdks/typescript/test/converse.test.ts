import { afterAll, describe, expect, it } from "vitest";
import { CancelledError, InvalidArgumentError, KakeyaError, SessionNotFoundError } from "../src/index.js";
import { OUT_OF_VOCABULARY, PROMPT, eventually, sharedClient } from "./support/fixtures.js";

const client = sharedClient();
afterAll(() => client.close());

const SAMPLING = { maxTokens: 6, seed: 99, temperature: 0.8, topK: 40 };

describe("Conversation (Converse)", () => {
  it("appends and generates over one stream with the same tokens as the unary calls", async () => {
    const unary = await client.createSession();
    await unary.append(PROMPT);
    const expected = await unary.generate(SAMPLING).toArray();
    await unary.close();

    const session = await client.createSession();
    const conversation = await session.converse();
    expect(conversation.historyLength).toBe(0);
    expect(await conversation.append(PROMPT)).toBe(PROMPT.length);
    const stream = conversation.generate(SAMPLING);
    expect(await stream.toArray()).toEqual(expected);
    expect(stream.stats).toMatchObject({ stopReason: "max_tokens", generatedTokenCount: 6 });
    expect(conversation.lastStats).toEqual(stream.stats);
    await conversation.close();
    expect((await session.info()).historyLength).toBe(PROMPT.length + 6);
    await session.close();
  });

  it("runs pipelined commands in the order they were issued", async () => {
    const session = await client.createSession({ initialTokens: PROMPT });
    const conversation = await session.converse();
    expect(conversation.historyLength).toBe(PROMPT.length);
    const first = conversation.generate({ maxTokens: 3 });
    const appended = conversation.append([1, 2]);
    const second = conversation.generate({ maxTokens: 3 });
    const firstTokens = await first.toArray();
    expect(await appended).toBe(PROMPT.length + 3 + 2);
    const secondTokens = await second.toArray();
    await conversation.close();

    const info = await session.info({ historyTailTokens: 8 });
    expect(info.historyTail).toEqual([...firstTokens, 1, 2, ...secondTokens]);
    await session.close();
  });

  it("cancel() ends the running generation normally with stop reason cancelled", async () => {
    const session = await client.createSession({ initialTokens: PROMPT });
    const conversation = await session.converse();
    const stream = conversation.generate({ maxTokens: 8192 });
    const received: number[] = [];
    for await (const token of stream) {
      received.push(token);
      if (received.length === 2) conversation.cancel();
    }
    expect(stream.stats?.stopReason).toBe("cancelled");
    expect(stream.stats?.generatedTokenCount).toBe(received.length);
    expect(await conversation.append([3])).toBe(PROMPT.length + received.length + 1);
    await conversation.close();
    await session.close();
  });

  it("breaking out of the loop cancels the generation and the stream stays usable", async () => {
    const session = await client.createSession({ initialTokens: PROMPT });
    const conversation = await session.converse();
    let count = 0;
    for await (const _ of conversation.generate({ maxTokens: 8192 })) {
      if (++count === 2) break;
    }
    const historyLength = await conversation.append([4]);
    expect(historyLength).toBeLessThan(PROMPT.length + 8192);
    expect(await conversation.generate({ maxTokens: 2 }).toArray()).toHaveLength(2);
    await conversation.close();
    await session.close();
  });

  it("aborting a generation's signal throws CancelledError and stops it on the server", async () => {
    const session = await client.createSession({ initialTokens: PROMPT });
    const conversation = await session.converse();
    const controller = new AbortController();
    const consume = async (): Promise<void> => {
      let count = 0;
      for await (const _ of conversation.generate({ maxTokens: 8192, signal: controller.signal })) {
        if (++count === 2) controller.abort();
      }
    };
    await expect(consume()).rejects.toBeInstanceOf(CancelledError);
    await eventually(async () => !(await session.info()).generating);
    expect((await session.info()).historyLength).toBeLessThan(PROMPT.length + 8192);
    await conversation.close();
    await session.close();
  });

  it("binding to an unknown session fails with SessionNotFoundError", async () => {
    await expect(client.session("no-such-session").converse()).rejects.toBeInstanceOf(SessionNotFoundError);
  });

  it("an invalid token ends the stream: pending and later commands fail with InvalidArgumentError", async () => {
    const session = await client.createSession({ initialTokens: PROMPT });
    const conversation = await session.converse();
    const bad = conversation.append([OUT_OF_VOCABULARY]);
    await expect(bad).rejects.toBeInstanceOf(InvalidArgumentError);
    expect(() => conversation.generate({ maxTokens: 1 })).toThrow(InvalidArgumentError);
    await conversation.close();
    expect((await session.info()).historyLength).toBe(PROMPT.length);
    await session.close();
  });

  it("abort() cancels the stream and fails pending commands with CancelledError", async () => {
    const session = await client.createSession({ initialTokens: PROMPT });
    const conversation = await session.converse();
    const stream = conversation.generate({ maxTokens: 8192 });
    const iterator = stream[Symbol.asyncIterator]();
    await iterator.next();
    const pendingAppend = conversation.append([1]);
    conversation.abort();
    await expect(pendingAppend).rejects.toBeInstanceOf(CancelledError);
    await expect(iterator.next()).rejects.toBeInstanceOf(CancelledError);
    await expect(conversation.append([1])).rejects.toBeInstanceOf(KakeyaError);
    await eventually(async () => !(await session.info()).generating);
    await session.close();
  });

  it("close() waits for the pending commands, then refuses new ones", async () => {
    const session = await client.createSession({ initialTokens: PROMPT });
    const conversation = await session.converse();
    const appended = conversation.append([9, 9]);
    await conversation.close();
    expect(await appended).toBe(PROMPT.length + 2);
    expect(() => conversation.generate({ maxTokens: 1 })).toThrow(/closed/);
    await session.close();
  });
});
