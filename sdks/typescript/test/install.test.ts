// The package as a user installs it: `npm pack` (which builds dist through the `prepare` script), then
// `npm install <tarball>` into a fresh project of each module system, then a generation against the shared daemon.
import { execFile } from "node:child_process";
import { mkdtempSync, readdirSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { promisify } from "node:util";
import { afterAll, describe, expect, inject, it } from "vitest";
import { PACKAGE_DIR } from "./support/daemon.js";
import { PROMPT } from "./support/fixtures.js";

const run = promisify(execFile);
const NPM = process.platform === "win32" ? "npm.cmd" : "npm";
const work = mkdtempSync(join(tmpdir(), "kakeya-install-"));
afterAll(() => rmSync(work, { recursive: true, force: true }));

// The same generation in both module systems: greedy, no EOS ids, so exactly 4 tokens.
const GENERATION = (address: string) => `
  const client = new Client(${JSON.stringify(address)}, { timeoutMs: 60000 });
  const session = await client.createSession({ initialTokens: ${JSON.stringify(PROMPT)}, eosTokenIds: [] });
  const tokens = await session.generate({ maxTokens: 4 }).toArray();
  await session.close();
  client.close();
  console.log(JSON.stringify(tokens));
`;

async function project(name: string, type: "module" | "commonjs", tarball: string): Promise<string> {
  const dir = join(work, name);
  rmSync(dir, { recursive: true, force: true });
  await run("mkdir", ["-p", dir]);
  writeFileSync(join(dir, "package.json"), JSON.stringify({ name, private: true, type }, null, 2));
  // --prefer-offline: the SDK's own dependencies come from the npm cache when the repository's install put them there.
  await run(NPM, ["install", "--prefer-offline", "--no-audit", "--no-fund", "--loglevel=error", tarball], {
    cwd: dir,
  });
  return dir;
}

describe("installing the packed package into a fresh project", () => {
  it("runs a generation from an ES module project and from a CommonJS project", async () => {
    await run(NPM, ["pack", "--pack-destination", work, "--loglevel=error"], { cwd: PACKAGE_DIR });
    const tarball = join(
      work,
      readdirSync(work).find((f) => f.endsWith(".tgz"))!,
    );
    const address = inject("daemonAddress");
    const esm = await project("esm-app", "module", tarball);
    writeFileSync(join(esm, "main.js"), `import { Client } from "@kakeya/runtime";\n${GENERATION(address)}`);
    const cjs = await project("cjs-app", "commonjs", tarball);
    writeFileSync(
      join(cjs, "main.js"),
      `const { Client } = require("@kakeya/runtime");\n(async () => {${GENERATION(address)}})().catch((e) => {
        console.error(e);
        process.exit(1);
      });`,
    );
    const [fromEsm, fromCjs] = await Promise.all(
      [esm, cjs].map(async (dir) => JSON.parse((await run(process.execPath, ["main.js"], { cwd: dir })).stdout)),
    );
    expect(fromEsm).toHaveLength(4);
    expect(fromCjs).toEqual(fromEsm);
  }, 300_000);
});
