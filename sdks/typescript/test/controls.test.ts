import { readFileSync } from "node:fs";
import { join } from "node:path";
import { afterAll, describe, expect, it } from "vitest";
import { InvalidArgumentError } from "../src/index.js";
import { BUNDLED_MODEL_DIR } from "./support/daemon.js";
import { OUT_OF_VOCABULARY, PROMPT, sharedClient } from "./support/fixtures.js";

const client = sharedClient();
afterAll(() => client.close());

/** The bundled tokenizer's byte-level symbols by id (digits and ASCII letters stand for themselves). */
const VOCAB = new Map<number, string>(
  Object.entries(
    JSON.parse(readFileSync(join(BUNDLED_MODEL_DIR, "tokenizer.json"), "utf8")).model.vocab as Record<string, number>,
  ).map(([text, id]) => [id, text]),
);
const EOS_IDS = JSON.parse(readFileSync(join(BUNDLED_MODEL_DIR, "config.json"), "utf8")).eos_token_id as number[];

describe("generation controls", () => {
  it("constrains the output to a regex, ends it with end-of-sequence and streams log-probabilities", async () => {
    const session = await client.createSession({ initialTokens: PROMPT });
    const stream = session.generate({ maxTokens: 16, grammar: { regex: "[0-9]{3}" }, logprobs: true, topLogprobs: 3 });
    const tokens = await stream.toArray();
    expect(stream.stats?.stopReason).toBe("eos");
    expect(EOS_IDS).toContain(tokens.at(-1));
    expect(
      tokens
        .slice(0, -1)
        .map((id) => VOCAB.get(id))
        .join(""),
    ).toMatch(/^[0-9]{3}$/);
    expect(stream.logprobs.map((s) => s.tokenId)).toEqual(tokens);
    for (const scored of stream.logprobs) {
      expect(scored.logprob).toBeLessThanOrEqual(0);
      expect(scored.topLogprobs.length).toBeLessThanOrEqual(3);
    }
    await session.close();
  });

  it("accepts a JSON schema as an object and applies it on a conversation too", async () => {
    const session = await client.createSession({ initialTokens: PROMPT });
    const conversation = await session.converse();
    const schema = {
      type: "object",
      properties: { ok: { type: "boolean" } },
      required: ["ok"],
      additionalProperties: false,
    };
    const stream = conversation.generate({ maxTokens: 24, grammar: { jsonSchema: schema }, logprobs: true });
    const tokens = await stream.toArray();
    expect(stream.stats?.stopReason).toBe("eos");
    const text = tokens
      .slice(0, -1)
      .map((id) => VOCAB.get(id))
      .join("");
    expect(JSON.parse(text)).toHaveProperty("ok");
    expect(stream.logprobs).toHaveLength(tokens.length);
    await conversation.close();
    await session.close();
  });

  it("stops after the first match of a stop sequence and says which one matched", async () => {
    const free = await (await client.createSession({ initialTokens: PROMPT })).generate({ maxTokens: 12 }).toArray();
    const stop = free.slice(4, 6);
    const end = free.findIndex((_, i) => free[i] === stop[0] && free[i + 1] === stop[1]) + 2;
    const session = await client.createSession({ initialTokens: PROMPT });
    const stream = session.generate({
      maxTokens: 12,
      stopSequences: [[OUT_OF_VOCABULARY - 1, OUT_OF_VOCABULARY - 1], stop],
    });
    expect(await stream.toArray()).toEqual(free.slice(0, end));
    expect(stream.stats).toMatchObject({ stopReason: "stop_sequence", stopSequenceIndex: 1 });
    await session.close();
  });

  it("rejects controls the server refuses with InvalidArgumentError and the reason", async () => {
    const session = await client.createSession({ initialTokens: PROMPT });
    await expect(session.generate({ maxTokens: 4, logprobs: true, topLogprobs: 99 }).toArray()).rejects.toThrow(
      InvalidArgumentError,
    );
    await expect(session.generate({ maxTokens: 4, grammar: { jsonSchema: "{not json" } }).toArray()).rejects.toThrow(
      /does not compile/,
    );
    await expect(session.generate({ maxTokens: 4, stopSequences: [[OUT_OF_VOCABULARY]] }).toArray()).rejects.toThrow(
      /outside the vocabulary/,
    );
    await session.close();
  });
});
