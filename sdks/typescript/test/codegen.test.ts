import { execFile } from "node:child_process";
import { appendFile, cp, mkdtemp, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { promisify } from "node:util";
import { describe, expect, it } from "vitest";
import { PACKAGE_DIR } from "./support/daemon.js";

const run = promisify(execFile);
const SCRIPT = join(PACKAGE_DIR, "scripts", "codegen.mjs");

async function check(dir?: string): Promise<{ code: number; output: string }> {
  const args = [SCRIPT, "--check", ...(dir === undefined ? [] : ["--dir", dir])];
  try {
    const { stdout, stderr } = await run(process.execPath, args, { cwd: PACKAGE_DIR });
    return { code: 0, output: stdout + stderr };
  } catch (error) {
    const failed = error as { code: number; stdout: string; stderr: string };
    return { code: failed.code, output: failed.stdout + failed.stderr };
  }
}

describe("scripts/codegen.mjs --check", () => {
  it("passes on the committed generated code", async () => {
    expect(await check()).toMatchObject({ code: 0 });
  });

  it("fails when a generated file was edited or an extra file was added", async () => {
    const edited = await mkdtemp(join(tmpdir(), "kakeya-codegen-"));
    await cp(join(PACKAGE_DIR, "src", "generated"), edited, { recursive: true });
    await appendFile(join(edited, "kakeya", "v1", "runtime.ts"), "\n// edited by hand\n");
    const editedResult = await check(edited);
    expect(editedResult.code).toBe(1);
    expect(editedResult.output).toContain("kakeya/v1/runtime.ts");

    const extra = await mkdtemp(join(tmpdir(), "kakeya-codegen-"));
    await cp(join(PACKAGE_DIR, "src", "generated"), extra, { recursive: true });
    await writeFile(join(extra, "leftover.ts"), "export {};\n");
    const extraResult = await check(extra);
    expect(extraResult.code).toBe(1);
    expect(extraResult.output).toContain("leftover.ts");
  });
});
