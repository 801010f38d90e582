import { readFileSync } from "node:fs";
import { join } from "node:path";
import { inject } from "vitest";
import { Client, type ClientOptions } from "../../src/index.js";
import { BUNDLED_MODEL_DIR } from "./daemon.js";

/** The size of the bundled model's vocabulary: the smallest token id the daemon refuses. */
export const OUT_OF_VOCABULARY: number = JSON.parse(
  readFileSync(join(BUNDLED_MODEL_DIR, "config.json"), "utf8"),
).vocab_size;

/** A prompt of token ids inside the bundled model's vocabulary. */
export const PROMPT = [39, 68, 75, 75, 78, 11, 220, 86, 78, 81, 75, 67, 0, 220, 257, 84, 82, 68, 81, 198];

/** A client of the shared daemon; the caller closes it. */
export function sharedClient(options: ClientOptions = {}): Client {
  return new Client(inject("daemonAddress"), { timeoutMs: 60_000, ...options });
}

/** Poll `check` until it returns true (every 20 ms, at most `limitMs`); fails the test otherwise. */
export async function eventually(check: () => Promise<boolean>, limitMs = 30_000): Promise<void> {
  const deadline = Date.now() + limitMs;
  while (!(await check())) {
    if (Date.now() > deadline) throw new Error(`condition not reached within ${limitMs} ms`);
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
}
