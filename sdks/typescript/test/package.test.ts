import { execFile } from "node:child_process";
import { existsSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { promisify } from "node:util";
import { describe, expect, it } from "vitest";
import { BUNDLED_MODEL_DIR, PACKAGE_DIR } from "./support/daemon.js";

const run = promisify(execFile);

interface Conditions {
  import: { types: string; default: string };
  require: { types: string; default: string };
}

// Loads the built package by its own name, as a dependent would, in one module system.
const PROBE = (model: string) => `
  const { Client, SessionNotFoundError, KakeyaError } = runtime;
  const client = new Client("127.0.0.1:1");
  client.close();
  const tokenizer = await tokenizers.Tokenizer.fromDirectory(${JSON.stringify(model)});
  console.log(JSON.stringify({
    client: typeof Client,
    hierarchy: new SessionNotFoundError("x") instanceof KakeyaError,
    ids: tokenizer.encode("hi"),
  }));
`;

describe("the built package (npm run build)", () => {
  const manifest = JSON.parse(readFileSync(join(PACKAGE_DIR, "package.json"), "utf8")) as {
    exports: Record<string, Conditions | string>;
  };

  it("has every file its exports map names", () => {
    for (const [entry, target] of Object.entries(manifest.exports)) {
      if (typeof target === "string") continue;
      for (const path of [target.import.types, target.import.default, target.require.types, target.require.default]) {
        expect(existsSync(join(PACKAGE_DIR, path)), `${entry}: ${path} (run npm run build)`).toBe(true);
      }
    }
  });

  it("loads as an ES module and as CommonJS, with the tokenizer entry point", async () => {
    const esm = `import * as runtime from "@kakeya/runtime"; import * as tokenizers from "@kakeya/runtime/tokenizer";
      ${PROBE(BUNDLED_MODEL_DIR)}`;
    const cjs = `(async () => { const runtime = require("@kakeya/runtime"); const tokenizers = require("@kakeya/runtime/tokenizer");
      ${PROBE(BUNDLED_MODEL_DIR)} })().catch((e) => { console.error(e); process.exit(1); });`;
    const outputs = await Promise.all([
      run(process.execPath, ["--input-type=module", "-e", esm], { cwd: PACKAGE_DIR }),
      run(process.execPath, ["--input-type=commonjs", "-e", cjs], { cwd: PACKAGE_DIR }),
    ]);
    const [esmResult, cjsResult] = outputs.map(({ stdout }) => JSON.parse(stdout));
    expect(esmResult).toEqual(cjsResult);
    expect(esmResult).toMatchObject({ client: "function", hierarchy: true });
    expect(esmResult.ids.length).toBeGreaterThan(0);
  });

  it("resolves the CommonJS half as CommonJS", () => {
    const marker = JSON.parse(readFileSync(join(PACKAGE_DIR, "dist", "cjs", "package.json"), "utf8")) as {
      type: string;
    };
    expect(marker.type).toBe("commonjs");
    expect(readFileSync(join(PACKAGE_DIR, "dist", "cjs", "index.js"), "utf8")).toContain("exports.Client");
  });
});
