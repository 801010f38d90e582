import { afterAll, describe, expect, it } from "vitest";
import { InvalidArgumentError, SessionNotFoundError } from "../src/index.js";
import { PROMPT, sharedClient } from "./support/fixtures.js";

const client = sharedClient();
afterAll(() => client.close());

async function collect(stream: AsyncIterable<number>): Promise<number[]> {
  const tokens: number[] = [];
  for await (const token of stream) tokens.push(token);
  return tokens;
}

describe("Session.fork", () => {
  it("branches the history with a copy of the KV cache; both continue like fresh sessions", async () => {
    const parent = await client.createSession({ initialTokens: PROMPT, label: "ts-parent" });
    const first = await collect(parent.generate({ maxTokens: 4 }));
    const history = [...PROMPT, ...first];

    const branch = await parent.fork();
    expect(branch.id).not.toBe(parent.id);
    expect(branch.historyLength).toBe(history.length);
    const info = await branch.info({ historyTailTokens: history.length });
    expect(info).toMatchObject({ historyTail: history, clientLabel: "ts-parent", pendingTokenCount: 1 });

    const branched = await collect(branch.generate({ maxTokens: 5 }));
    expect(branch.lastStats?.prefillTokenCount).toBe(1);
    const fresh = await client.createSession({ initialTokens: history });
    expect(branched).toEqual(await collect(fresh.generate({ maxTokens: 5 })));
    expect((await parent.info()).historyLength).toBe(history.length);

    const short = await parent.fork({ prefixTokens: 3, label: "ts-short" });
    expect(await short.info()).toMatchObject({ historyLength: 3, clientLabel: "ts-short" });
    for (const session of [parent, branch, short, fresh]) await session.close();
  });

  it("refuses a bad prefix locally and a prefix beyond the history on the server", async () => {
    const parent = await client.createSession({ initialTokens: PROMPT.slice(0, 3) });
    await expect(parent.fork({ prefixTokens: -1 })).rejects.toBeInstanceOf(InvalidArgumentError);
    await expect(parent.fork({ prefixTokens: 4 })).rejects.toBeInstanceOf(InvalidArgumentError);
    await parent.close();
    await expect(parent.fork()).rejects.toBeInstanceOf(SessionNotFoundError);
  });
});
