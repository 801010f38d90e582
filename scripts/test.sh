#!/usr/bin/env bash
# Set up .venv, node_modules and the Debian packages the tests need (scripts/install_system_packages.sh) if needed,
# then run every check of the repository and the whole test suite:
# generated code is current, buf lint and breaking-change check, ruff, mypy, the TypeScript SDK (generated code
# is current, prettier, type-check, build and vitest against real daemons), pytest on one worker per core (at most
# four, pytest-xdist; each test file runs whole on one worker; `-n 0` among the arguments runs it in this process).
# Fails (non-zero exit) as soon as any check or test fails.
#
# Usage: scripts/test.sh [extra pytest arguments...]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh --dev
scripts/install_system_packages.sh --check 2>/dev/null || scripts/install_system_packages.sh
export PATH="$PWD/.venv/bin:$PWD/node_modules/.bin:$PATH"

step() { printf '\n== %s\n' "$*" >&2; }

step "generated code is current"
python scripts/codegen.py --check

step "buf lint"
buf lint

step "buf breaking (against the previous commit)"
if git rev-parse --verify --quiet HEAD~1 >/dev/null && git cat-file -e HEAD~1:proto 2>/dev/null; then
  buf breaking proto --against ".git#ref=HEAD~1,subdir=proto"
else
  echo "no previous commit holds proto/: nothing to compare against" >&2
fi

step "ruff"
ruff check .
ruff format --check .

step "mypy"
mypy
mypy sdks/python/examples scripts

step "TypeScript SDK: generated code is current"
(cd sdks/typescript && node scripts/codegen.mjs --check)

step "TypeScript SDK: prettier and type-check"
(cd sdks/typescript && npm run --silent format:check && npm run --silent typecheck)

step "TypeScript SDK: build and vitest (real daemons on loopback)"
(cd sdks/typescript && npm test --silent)

step "pytest"
python -m pytest -n auto --maxprocesses 4 --dist loadfile "$@"
