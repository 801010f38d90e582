// Runs test/support/python_reference.py with the repository's Python to get the same generations from Python.
import { execFile } from "node:child_process";
import { join } from "node:path";
import { promisify } from "node:util";
import { PACKAGE_DIR, PYTHON, REPO_ROOT } from "./daemon.js";

const run = promisify(execFile);

export interface ReferenceCase {
  address: string;
  initialTokens?: number[];
  appends?: number[][];
  maxTokens: number;
  seed?: number;
  temperature?: number;
  topP?: number;
  topK?: number;
}

export interface ReferenceResult {
  tokens: number[];
  stopReason: string | null;
}

/** The token streams the Python reference client receives for `cases`, in order. */
export async function pythonReference(cases: ReferenceCase[]): Promise<ReferenceResult[]> {
  const payload = cases.map((c) => ({
    address: c.address,
    initial_tokens: c.initialTokens ?? [],
    appends: c.appends ?? [],
    max_tokens: c.maxTokens,
    ...(c.seed === undefined ? {} : { seed: c.seed }),
    ...(c.temperature === undefined ? {} : { temperature: c.temperature }),
    ...(c.topP === undefined ? {} : { top_p: c.topP }),
    ...(c.topK === undefined ? {} : { top_k: c.topK }),
  }));
  const child = run(PYTHON, [join(PACKAGE_DIR, "test", "support", "python_reference.py")], {
    cwd: REPO_ROOT,
    timeout: 300_000,
    maxBuffer: 16 << 20,
  });
  child.child.stdin?.end(JSON.stringify(payload));
  const { stdout } = await child;
  const results = JSON.parse(stdout) as Array<{ tokens: number[]; stop_reason: string | null }>;
  return results.map((r) => ({ tokens: r.tokens, stopReason: r.stop_reason }));
}
