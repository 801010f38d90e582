#!/usr/bin/env node
// Build the package twice with tsc: ES modules into dist/esm and CommonJS into dist/cjs, each with .d.ts files.
//
// Usage:
//   node scripts/build.mjs   # (npm run build)
//
// dist/cjs gets its own package.json declaring "type": "commonjs", so Node and TypeScript read that half as CommonJS
// while the package itself is ESM.
import { execFileSync } from "node:child_process";
import { rmSync, writeFileSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const PACKAGE_DIR = resolve(dirname(fileURLToPath(import.meta.url)), "..");
const TSC = join(PACKAGE_DIR, "node_modules", ".bin", "tsc");

rmSync(join(PACKAGE_DIR, "dist"), { recursive: true, force: true });
const tsc = (...args) =>
  execFileSync(TSC, ["-p", "tsconfig.build.json", ...args], { cwd: PACKAGE_DIR, stdio: "inherit" });
tsc();
tsc("--module", "CommonJS", "--moduleResolution", "Node10", "--outDir", "dist/cjs");
writeFileSync(join(PACKAGE_DIR, "dist", "cjs", "package.json"), JSON.stringify({ type: "commonjs" }, null, 2) + "\n");
console.log("built dist/esm and dist/cjs");
