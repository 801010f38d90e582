import { execFile } from "node:child_process";
import { mkdtemp, writeFile, copyFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { promisify } from "node:util";
import { beforeAll, describe, expect, it } from "vitest";
import { KakeyaError } from "../src/index.js";
import { type ChatMessage, Tokenizer, TokenizerError } from "../src/tokenizer.js";
import { BUNDLED_MODEL_DIR, PYTHON, REPO_ROOT } from "./support/daemon.js";

const TEXTS = ["Hello, world!", "  leading spaces and ünïcödé — 漢字 🙂", "<|im_start|>user\nhi<|im_end|>\n", ""];
const CONVERSATION: ChatMessage[] = [
  { role: "system", content: "You are terse." },
  { role: "user", content: "Hi there" },
  { role: "assistant", content: "Hello." },
  { role: "user", content: "What is 2+2?" },
];

// What the Python side (the `tokenizers` and `transformers` packages the server uses) makes of the same inputs.
const PYTHON_SIDE = `
import json, sys
from tokenizers import Tokenizer
from transformers import AutoTokenizer
directory, texts, conversation = json.load(sys.stdin)
fast = Tokenizer.from_file(directory + "/tokenizer.json")
auto = AutoTokenizer.from_pretrained(directory)
rendered = auto.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
json.dump({
    "encoded": [fast.encode(t, add_special_tokens=False).ids for t in texts],
    "rendered": rendered,
    "chat_ids": auto(rendered, add_special_tokens=False)["input_ids"],
}, sys.stdout)
`;

interface PythonSide {
  encoded: number[][];
  rendered: string;
  chat_ids: number[];
}

let tokenizer: Tokenizer;
let python: PythonSide;

beforeAll(async () => {
  tokenizer = await Tokenizer.fromDirectory(BUNDLED_MODEL_DIR);
  const child = promisify(execFile)(PYTHON, ["-c", PYTHON_SIDE], {
    cwd: REPO_ROOT,
    env: { ...process.env, HF_HUB_OFFLINE: "1" },
  });
  child.child.stdin?.end(JSON.stringify([BUNDLED_MODEL_DIR, TEXTS, CONVERSATION]));
  python = JSON.parse((await child).stdout) as PythonSide;
});

describe("Tokenizer", () => {
  it("encodes text to the same ids as the Python tokenizers library, and decodes them back", () => {
    for (const [index, text] of TEXTS.entries()) {
      const ids = tokenizer.encode(text);
      expect(ids, JSON.stringify(text)).toEqual(python.encoded[index]);
      expect(tokenizer.decode(ids)).toBe(text);
    }
  });

  it("renders the chat template and its ids as transformers' apply_chat_template does", () => {
    expect(tokenizer.applyChatTemplate(CONVERSATION)).toBe(python.rendered);
    expect(tokenizer.tokensForChat(CONVERSATION)).toEqual(python.chat_ids);
  });

  it("names special tokens, the EOS ids and the text that closes an assistant turn", () => {
    const imEnd = tokenizer.tokenId("<|im_end|>");
    expect(tokenizer.eosTokenIds).toEqual([imEnd]);
    expect(tokenizer.decode([imEnd], { skipSpecialTokens: true })).toBe("");
    expect(tokenizer.assistantSuffix()).toBe("<|im_end|>\n");
    expect(() => tokenizer.tokenId("<|no such token|>")).toThrow(TokenizerError);
  });

  it("rendering turn by turn and closing each assistant turn rebuilds the whole rendered conversation", () => {
    const first = tokenizer.tokensForChat(CONVERSATION.slice(0, 2));
    const reply = tokenizer.encode("Hello.");
    const closing = tokenizer.encode(tokenizer.assistantSuffix());
    const next = tokenizer.tokensForChat(CONVERSATION.slice(3));
    expect([...first, ...reply, ...closing, ...next]).toEqual(python.chat_ids);
  });

  it("streams text from ids, holding back characters split across byte-level tokens", () => {
    const text = TEXTS[1]!;
    const decoder = tokenizer.streamDecoder();
    const pieces = tokenizer.encode(text).map((id) => decoder.push(id));
    pieces.push(decoder.flush());
    expect(pieces.join("")).toBe(text);
    expect(pieces.some((piece) => piece.includes("\uFFFD"))).toBe(false);
  });

  it("fails with TokenizerError for a missing or malformed tokenizer file and a missing template", async () => {
    const directory = await mkdtemp(join(tmpdir(), "kakeya-tokenizer-"));
    await expect(Tokenizer.fromDirectory(directory)).rejects.toBeInstanceOf(TokenizerError);
    await writeFile(join(directory, "tokenizer.json"), "{ not json");
    const error = await Tokenizer.fromDirectory(directory).catch((e: unknown) => e);
    expect(error).toBeInstanceOf(TokenizerError);
    expect(error).toBeInstanceOf(KakeyaError);

    await copyFile(join(BUNDLED_MODEL_DIR, "tokenizer.json"), join(directory, "tokenizer.json"));
    const bare = await Tokenizer.fromDirectory(directory);
    expect(bare.hasChatTemplate).toBe(false);
    expect(bare.eosTokenIds).toEqual([]);
    expect(() => bare.applyChatTemplate(CONVERSATION)).toThrow(TokenizerError);
  });
});
