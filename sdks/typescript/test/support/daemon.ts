// Runs the repository's own `kakeya-runtime serve` as a child process on a free loopback port.
import { type ChildProcess, spawn } from "node:child_process";
import { existsSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";

export const REPO_ROOT = resolve(dirname(fileURLToPath(import.meta.url)), "..", "..", "..", "..");
export const PACKAGE_DIR = join(REPO_ROOT, "sdks", "typescript");
/** The daemon's console script; KAKEYA_RUNTIME_BIN overrides the repository's virtual environment. */
export const RUNTIME_BIN = process.env.KAKEYA_RUNTIME_BIN ?? join(REPO_ROOT, ".venv", "bin", "kakeya-runtime");
/** The Python interpreter of the repository's environment (for the cross-language reference). */
export const PYTHON = process.env.KAKEYA_PYTHON ?? join(REPO_ROOT, ".venv", "bin", "python");
export const BUNDLED_MODEL_DIR = join(REPO_ROOT, "inference_engine", "models", "kakeya-tiny");

export interface Daemon {
  /** `host:port` the daemon's gRPC server listens on. */
  readonly address: string;
  /** Everything the daemon wrote to stderr so far. */
  readonly log: string[];
  /** SIGTERM, then wait for a graceful exit (SIGKILL after `graceMs`). */
  stop(graceMs?: number): Promise<number | null>;
}

/**
 * Start `kakeya-runtime serve --model kakeya-tiny --port 0 --metrics-port -1 --log-format json <args>` (a
 * `--model` in `args` wins) and wait until it listens.
 */
export async function startDaemon(args: string[] = [], startupTimeoutMs = 150_000): Promise<Daemon> {
  if (!existsSync(RUNTIME_BIN)) {
    throw new Error(`${RUNTIME_BIN} is missing: run scripts/bootstrap.sh at the repository root`);
  }
  const child = spawn(
    RUNTIME_BIN,
    ["serve", "--model", "kakeya-tiny", "--port", "0", "--metrics-port", "-1", "--log-format", "json", ...args],
    {
      stdio: ["ignore", "ignore", "pipe"],
      env: { ...process.env, HF_HUB_OFFLINE: "1" },
    },
  );
  const log: string[] = [];
  const exited = new Promise<number | null>((done) => child.once("exit", (code) => done(code)));
  const address = await new Promise<string>((resolveAddress, reject) => {
    const timer = setTimeout(() => {
      child.kill("SIGKILL");
      reject(new Error(`the daemon did not start within ${startupTimeoutMs} ms:\n${log.join("\n")}`));
    }, startupTimeoutMs);
    createInterface({ input: child.stderr! }).on("line", (line) => {
      log.push(line);
      const record = parseJson(line);
      if (record?.msg === "listening" && typeof record.grpc === "string") {
        clearTimeout(timer);
        resolveAddress(record.grpc);
      }
    });
    void exited.then((code) => {
      clearTimeout(timer);
      reject(new Error(`the daemon exited with ${code} before listening:\n${log.join("\n")}`));
    });
  });
  return { address, log, stop: (graceMs = 30_000) => stop(child, exited, graceMs) };
}

function parseJson(line: string): Record<string, unknown> | undefined {
  if (!line.startsWith("{")) return undefined;
  try {
    return JSON.parse(line) as Record<string, unknown>;
  } catch {
    return undefined;
  }
}

async function stop(child: ChildProcess, exited: Promise<number | null>, graceMs: number): Promise<number | null> {
  if (child.exitCode !== null || child.signalCode !== null) return child.exitCode;
  child.kill("SIGTERM");
  const timer = setTimeout(() => child.kill("SIGKILL"), graceMs);
  const code = await exited;
  clearTimeout(timer);
  return code;
}
