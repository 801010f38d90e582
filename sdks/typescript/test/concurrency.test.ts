import { afterAll, describe, expect, it } from "vitest";
import type { Session } from "../src/index.js";
import { PROMPT, sharedClient } from "./support/fixtures.js";

// The shared daemon runs with --max-concurrent 2.
const client = sharedClient();
afterAll(() => client.close());

const PROMPT_B = [...PROMPT].reverse();

async function sequentialReference(history: number[], seed: number): Promise<number[]> {
  const session = await client.createSession({ initialTokens: history });
  const tokens = await session.generate({ maxTokens: 8, seed, temperature: 1.0 }).toArray();
  await session.close();
  return tokens;
}

describe("two sessions at once", () => {
  it("generate concurrently, each with the tokens it gets alone", async () => {
    const expectedA = await sequentialReference(PROMPT, 1);
    const expectedB = await sequentialReference(PROMPT_B, 2);

    const a = await client.createSession({ initialTokens: PROMPT });
    const b = await client.createSession({ initialTokens: PROMPT_B });
    const [tokensA, tokensB] = await Promise.all([
      a.generate({ maxTokens: 8, seed: 1, temperature: 1.0 }).toArray(),
      b.generate({ maxTokens: 8, seed: 2, temperature: 1.0 }).toArray(),
    ]);
    expect(tokensA).toEqual(expectedA);
    expect(tokensB).toEqual(expectedB);
    await Promise.all([a.close(), b.close()]);
  });

  it("both generate at the same time: each has streamed a token while the other is still running", async () => {
    const sessions: Session[] = await Promise.all([
      client.createSession({ initialTokens: PROMPT }),
      client.createSession({ initialTokens: PROMPT_B }),
    ]);
    const iterators = sessions.map((s) => s.generate({ maxTokens: 8192 })[Symbol.asyncIterator]());
    // With one slot the second generation could not stream before the first one finished all 8192 tokens.
    const firsts = await Promise.all(iterators.map((it) => it.next()));
    expect(firsts.every((r) => !r.done)).toBe(true);
    const infos = await Promise.all(sessions.map((s) => s.info()));
    expect(infos.map((i) => i.generating)).toEqual([true, true]);
    await Promise.all(iterators.map((it) => it.return?.()));
    await Promise.all(sessions.map((s) => s.close()));
  });

  it("one session appends while another generates", async () => {
    const generating = await client.createSession({ initialTokens: PROMPT });
    const other = await client.createSession();
    const iterator = generating.generate({ maxTokens: 8192 })[Symbol.asyncIterator]();
    await iterator.next();
    expect(await other.append(PROMPT, { timeoutMs: 10_000 })).toBe(PROMPT.length);
    expect((await generating.info()).generating).toBe(true);
    await iterator.return?.();
    await Promise.all([generating.close(), other.close()]);
  });
});
