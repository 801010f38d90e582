import { afterAll, describe, expect, inject, it } from "vitest";
import { PROMPT, sharedClient } from "./support/fixtures.js";
import { type ReferenceCase, pythonReference } from "./support/python-reference.js";

const client = sharedClient();
afterAll(() => client.close());

const CASES: Array<Omit<ReferenceCase, "address">> = [
  { initialTokens: PROMPT, maxTokens: 10 },
  { initialTokens: PROMPT, maxTokens: 10, seed: 7, temperature: 0.8, topP: 0.9, topK: 40 },
  {
    initialTokens: PROMPT.slice(0, 6),
    appends: [PROMPT.slice(6, 13), PROMPT.slice(13)],
    maxTokens: 10,
    seed: 123456789,
    temperature: 1.2,
  },
  { appends: [PROMPT], maxTokens: 10, seed: 3, temperature: 0.6, topK: 5 },
];

describe("the TypeScript and Python clients", () => {
  it("receive the same token stream for the same history and seed", async () => {
    const address = inject("daemonAddress");
    const reference = await pythonReference(CASES.map((c) => ({ ...c, address })));

    for (const [index, c] of CASES.entries()) {
      const session = await client.createSession({ initialTokens: c.initialTokens ?? [] });
      for (const tokens of c.appends ?? []) await session.append(tokens);
      const { maxTokens, seed, temperature, topP, topK } = c;
      const tokens = await session.generate({ maxTokens, seed, temperature, topP, topK }).toArray();
      await session.close();

      expect(tokens, `case ${index}`).toEqual(reference[index]!.tokens);
      expect(session.lastStats?.stopReason, `case ${index}`).toBe(reference[index]!.stopReason);
      expect(tokens).toHaveLength(maxTokens);
    }
  });

  it("differ when the seed differs (the comparison can fail)", async () => {
    const address = inject("daemonAddress");
    const base = { initialTokens: PROMPT, maxTokens: 10, temperature: 1.5 };
    const [python] = await pythonReference([{ ...base, seed: 1, address }]);
    const session = await client.createSession({ initialTokens: PROMPT });
    const tokens = await session.generate({ maxTokens: 10, temperature: 1.5, seed: 2 }).toArray();
    await session.close();
    expect(tokens).not.toEqual(python!.tokens);
  });
});
