/**
 * A terminal chat over one append-only Kakeya session, tokenizing in JavaScript.
 *
 * Each turn appends only the new tokens: the user's message rendered with the chat template, after the text that
 * closes the previous assistant turn. Earlier turns are never re-rendered, so the server's cache stays valid.
 * Ctrl-C stops a running reply (through an AbortSignal); Ctrl-D ends the chat.
 *
 * Usage (in sdks/typescript, with a daemon running, e.g. `scripts/serve.sh` at the repository root):
 *   npx tsx examples/chat.ts [--address 127.0.0.1:50051] [--model-dir DIR] [--max-tokens 64]
 *                            [--temperature 0.7] [--seed N] [--system TEXT] [--api-key KEY]
 * --model-dir holds the served model's tokenizer.json (default: the bundled kakeya-tiny model, a code-completion
 * model whose replies are Python-flavoured text, not an assistant's).
 */
import { fileURLToPath } from "node:url";
import { createInterface } from "node:readline";
import { parseArgs } from "node:util";
import { CancelledError, Client, type Session } from "@kakeya/runtime";
import { type ChatMessage, Tokenizer } from "@kakeya/runtime/tokenizer";

const BUNDLED_MODEL_DIR = fileURLToPath(new URL("../../../inference_engine/models/kakeya-tiny", import.meta.url));

const { values: args } = parseArgs({
  options: {
    address: { type: "string", default: "127.0.0.1:50051" },
    "model-dir": { type: "string", default: BUNDLED_MODEL_DIR },
    "max-tokens": { type: "string", default: "64" },
    temperature: { type: "string", default: "0.7" },
    seed: { type: "string" },
    system: { type: "string" },
    "api-key": { type: "string" },
  },
});

const tokenizer = await Tokenizer.fromDirectory(args["model-dir"]);
const eosTokenIds = tokenizer.eosTokenIds;
const eosText = eosTokenIds.length > 0 ? tokenizer.decode(eosTokenIds) : undefined;
const client = new Client(args.address, { apiKey: args["api-key"], timeoutMs: 30_000 });
const session: Session = await client.createSession({ label: "examples/chat", eosTokenIds });

let turn = 0;
let lastReplyEndedWithEos = false;
let running: AbortController | undefined;

/** The tokens that start a turn: close the previous assistant turn, then the new user message and the
 * assistant header. */
function turnTokens(userText: string): number[] {
  const message: ChatMessage = { role: "user", content: userText };
  if (turn === 0) {
    const opening: ChatMessage[] = args.system ? [{ role: "system", content: args.system }, message] : [message];
    return tokenizer.tokensForChat(opening);
  }
  let closing = tokenizer.assistantSuffix();
  // A reply that ended with EOS already holds the start of the closing text.
  if (lastReplyEndedWithEos && eosText !== undefined && closing.startsWith(eosText)) {
    closing = closing.slice(eosText.length);
  }
  return [...tokenizer.encode(closing), ...tokenizer.tokensForChat([message])];
}

async function reply(userText: string): Promise<void> {
  await session.append(turnTokens(userText));
  turn += 1;
  running = new AbortController();
  const stream = session.generate({
    maxTokens: Number(args["max-tokens"]),
    temperature: Number(args.temperature),
    seed: args.seed === undefined ? undefined : BigInt(args.seed) + BigInt(turn),
    signal: running.signal,
  });
  const text = tokenizer.streamDecoder({ skipSpecialTokens: true });
  try {
    for await (const id of stream) process.stdout.write(text.push(id));
    process.stdout.write(`${text.flush()}\n`);
    const stats = stream.stats;
    lastReplyEndedWithEos = stats?.stopReason === "eos";
    console.error(
      `[${stats?.generatedTokenCount} tokens, stop: ${stats?.stopReason}, prefill ${stats?.prefillTokenCount} tokens]`,
    );
  } catch (error) {
    if (!(error instanceof CancelledError)) throw error;
    // Every token streamed before the cancel is in the history: the next turn closes this reply normally.
    process.stdout.write(`${text.flush()}\n`);
    lastReplyEndedWithEos = false;
    console.error("[stopped]");
  } finally {
    running = undefined;
  }
}

process.on("SIGINT", () => {
  if (running) running.abort();
  else lines.close();
});

const lines = createInterface({ input: process.stdin, terminal: false });
try {
  for await (const line of lines) {
    if (line.trim() === "") continue;
    await reply(line);
  }
} finally {
  const historyLength = await session.close();
  console.error(`[session closed after ${turn} turns, ${historyLength} tokens]`);
  client.close();
}
