#!/usr/bin/env node
// Regenerate the SDK's protocol code (src/generated/) from the repository's proto/ with buf and ts-proto.
//
// Usage:
//   node scripts/codegen.mjs           # rewrite src/generated/ from proto/ (npm run codegen)
//   node scripts/codegen.mjs --check   # exit 1 if src/generated/ differs from a fresh generation (npm run codegen:check)
//   node scripts/codegen.mjs --check --dir DIR   # compare DIR instead of src/generated/
//
// buf comes from the repository root's node_modules (scripts/bootstrap.sh --dev installs it), ts-proto from this
// package's node_modules; both are pinned by their lock files, so a fresh generation is byte-for-byte reproducible.
import { execFileSync } from "node:child_process";
import { existsSync, mkdtempSync, readdirSync, readFileSync, rmSync, cpSync, statSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, relative, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const PACKAGE_DIR = resolve(dirname(fileURLToPath(import.meta.url)), "..");
const REPO_ROOT = resolve(PACKAGE_DIR, "..", "..");
const GENERATED = "src/generated";
const BUF = join(REPO_ROOT, "node_modules", ".bin", "buf");
const PLUGIN = join(PACKAGE_DIR, "node_modules", ".bin", "protoc-gen-ts_proto");

function listFiles(root) {
  if (!existsSync(root)) return [];
  const out = [];
  const walk = (dir) => {
    for (const name of readdirSync(dir).sort()) {
      const path = join(dir, name);
      if (statSync(path).isDirectory()) walk(path);
      else out.push(relative(root, path));
    }
  };
  walk(root);
  return out;
}

function generate(outputBase) {
  for (const [tool, hint] of [
    [BUF, "run scripts/bootstrap.sh --dev at the repository root"],
    [PLUGIN, "run npm install in sdks/typescript"],
  ]) {
    if (!existsSync(tool)) throw new Error(`${tool} is missing: ${hint}`);
  }
  execFileSync(BUF, ["generate", REPO_ROOT, "--template", "buf.gen.yaml", "--output", outputBase], {
    cwd: PACKAGE_DIR,
    stdio: "inherit",
  });
  return join(outputBase, GENERATED);
}

function main() {
  const args = process.argv.slice(2);
  const check = args.includes("--check");
  const dirFlag = args.indexOf("--dir");
  const current = dirFlag >= 0 ? resolve(args[dirFlag + 1] ?? "") : join(PACKAGE_DIR, GENERATED);
  const scratch = mkdtempSync(join(tmpdir(), "kakeya-ts-codegen-"));
  try {
    const fresh = generate(scratch);
    if (!check) {
      rmSync(current, { recursive: true, force: true });
      cpSync(fresh, current, { recursive: true });
      console.log(`wrote ${relative(REPO_ROOT, current)}`);
      return 0;
    }
    const expected = listFiles(fresh);
    const present = listFiles(current);
    const stale = [...new Set([...expected, ...present])].filter((name) => {
      const a = join(fresh, name);
      const b = join(current, name);
      return !existsSync(a) || !existsSync(b) || !readFileSync(a).equals(readFileSync(b));
    });
    if (stale.length > 0) {
      console.error(`stale generated code (run \`npm run codegen\` in sdks/typescript): ${stale.join(", ")}`);
      return 1;
    }
    console.log(`${relative(REPO_ROOT, current)} is current`);
    return 0;
  } finally {
    rmSync(scratch, { recursive: true, force: true });
  }
}

process.exit(main());
