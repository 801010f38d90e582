import { afterAll, describe, expect, it } from "vitest";
import { CancelledError, InvalidArgumentError, SessionNotFoundError } from "../src/index.js";
import { SHARED_DAEMON_ARGS } from "./support/global-setup.js";
import { PROMPT, sharedClient } from "./support/fixtures.js";

const client = sharedClient();
afterAll(() => client.close());

const maxGenerateTokens = Number(SHARED_DAEMON_ARGS[SHARED_DAEMON_ARGS.indexOf("--max-generate-tokens") + 1]);

describe("model facts and limits", () => {
  it("reports the bundled model's facts and the server's limits", async () => {
    const info = await client.modelInfo();
    expect(info.vocabSize).toBe(4096);
    expect(info.eosTokenIds).toEqual([2, 0]);
    expect(info.trainedContextTokens).toBe(8192);
    expect(info.modelName).toBe("kakeya-tiny");
    expect(info.chatTemplate).toContain("{%");
    expect(info.limits.maxGenerateTokens).toBe(maxGenerateTokens);
    expect(info.limits.maxAppendTokens).toBe(512);
    expect(info.limits.maxConcurrentGenerations).toBe(2);
    expect(info.limits.maxBatchSize).toBe(16);
    expect(info.limits.prefillChunkTokens).toBe(512);
    expect(await client.modelInfo()).toBe(info);
  });

  it("refuses maxTokens outside 1..the server's limit before any call, naming the range", async () => {
    const session = await client.createSession({ initialTokens: PROMPT });
    for (const maxTokens of [-1, 0, maxGenerateTokens + 1, 1.5]) {
      expect(() => session.generate({ maxTokens })).toThrow(InvalidArgumentError);
      expect(() => session.generate({ maxTokens })).toThrow(`1..${maxGenerateTokens} (the server's limit)`);
    }
    const conversation = await session.converse();
    expect(() => conversation.generate({ maxTokens: 0 })).toThrow(`1..${maxGenerateTokens}`);
    await conversation.close();
    await session.close();
  });

  it("a second close returns the same history length instead of failing", async () => {
    const session = await client.createSession({ initialTokens: PROMPT });
    expect(await session.close()).toBe(PROMPT.length);
    expect(await session.close()).toBe(PROMPT.length);
    await expect(session.info()).rejects.toBeInstanceOf(SessionNotFoundError);
  });

  it("errors carry the status name as well as its number", async () => {
    const error = await client
      .session("no-such-session")
      .info()
      .catch((e: unknown) => e);
    expect(error).toBeInstanceOf(SessionNotFoundError);
    expect((error as SessionNotFoundError).status).toBe("NOT_FOUND");
    expect((error as SessionNotFoundError).code).toBe(5);
  });

  it("sessions stop on the model's EOS ids unless given an empty list", async () => {
    // `if __name__ == "__main__":\n    main()\n`: the end of a Python file, after which the model ends its text.
    const endOfFile = [779, 518, 380, 316, 565, 1569, 837, 2933, 281, 2747, 310, 202];
    const { eosTokenIds } = await client.modelInfo();
    const byDefault = await client.createSession({ initialTokens: endOfFile });
    const stopped = await byDefault.generate({ maxTokens: 8 }).toArray();
    await byDefault.close();
    expect(byDefault.lastStats?.stopReason).toBe("eos");
    expect(eosTokenIds).toContain(stopped.at(-1));
    const optedOut = await client.createSession({ initialTokens: endOfFile, eosTokenIds: [] });
    const stream = await optedOut.generate({ maxTokens: 8 }).toArray();
    await optedOut.close();
    expect(stream).toHaveLength(8);
    expect(stream.slice(0, stopped.length)).toEqual(stopped);
  });

  it("info() right after an abort resolved does not report generating", async () => {
    for (let round = 0; round < 5; round++) {
      const session = await client.createSession({ initialTokens: PROMPT, eosTokenIds: [] });
      const controller = new AbortController();
      let received = 0;
      await expect(
        (async () => {
          for await (const _ of session.generate({ maxTokens: 4000, signal: controller.signal })) {
            if (++received === 2) controller.abort();
          }
        })(),
      ).rejects.toBeInstanceOf(CancelledError);
      expect((await session.info()).generating).toBe(false);
      await session.close();
    }
  });
});
