// One daemon shared by the suites that need no special server flags: the bundled model, two generation slots
// (for the concurrency suite) and a small append limit (for the RESOURCE_EXHAUSTED case).
import type { TestProject } from "vitest/node";
import { startDaemon } from "./daemon.js";

export const SHARED_DAEMON_ARGS = [
  "--max-concurrent",
  "2",
  "--max-append-tokens",
  "512",
  "--max-generate-tokens",
  "8192",
];

export default async function setup(project: TestProject): Promise<() => Promise<void>> {
  const daemon = await startDaemon(SHARED_DAEMON_ARGS);
  project.provide("daemonAddress", daemon.address);
  return async () => {
    await daemon.stop();
  };
}

declare module "vitest" {
  export interface ProvidedContext {
    daemonAddress: string;
  }
}
