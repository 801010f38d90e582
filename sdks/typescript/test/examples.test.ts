import { spawn } from "node:child_process";
import { join } from "node:path";
import { describe, expect, inject, it } from "vitest";
import { PACKAGE_DIR } from "./support/daemon.js";

function runExample(args: string[], input: string): Promise<{ code: number | null; stdout: string; stderr: string }> {
  return new Promise((resolve, reject) => {
    const child = spawn(join(PACKAGE_DIR, "node_modules", ".bin", "tsx"), [join("examples", "chat.ts"), ...args], {
      cwd: PACKAGE_DIR,
      stdio: ["pipe", "pipe", "pipe"],
    });
    let stdout = "";
    let stderr = "";
    child.stdout.on("data", (chunk: Buffer) => (stdout += chunk.toString()));
    child.stderr.on("data", (chunk: Buffer) => (stderr += chunk.toString()));
    child.on("error", reject);
    child.on("close", (code) => resolve({ code, stdout, stderr }));
    child.stdin.end(input);
  });
}

describe("examples/chat.ts", () => {
  it("chats two turns on one session against the running daemon and closes it", async () => {
    const { code, stderr } = await runExample(
      ["--address", inject("daemonAddress"), "--max-tokens", "6", "--seed", "5", "--system", "Be brief."],
      "Hello there\nAnd again\n",
    );
    expect(stderr).toMatch(/\[6 tokens, stop: max_tokens, prefill \d+ tokens\][\s\S]*\[\d+ tokens, stop: \w+/);
    expect(stderr).toMatch(/\[session closed after 2 turns, \d+ tokens\]/);
    expect(code).toBe(0);
  });
});
