#!/usr/bin/env bash
# The 0.8B step at 8k on the device machine, after Triton 3.7.1 and fla are staged into /tmp/site
# (../shared/gpu/stage-wheels.sh): the first step of a fresh process with an empty kernel cache (fla's Triton
# kernels compile and autotune), the first step of a second process that finds the cache, the step itself, and
# where the step makes the host wait (benchmarks/host_syncs.py: wall vs GPU-busy time).
#   bash benchmarks/gpu_speed.sh            # results under $OUT: cold/, warm/, syncs/
# The kernel cache is Triton's: compiled kernels and (fla passes cache_results) autotune choices, under
# $TRITON_CACHE_DIR (default ~/.triton/cache). Here it is a fresh folder so that the first run is cold.
set -uo pipefail
export PYTHONPATH=/tmp/site:$(ls -d "$PWD"/packages/*/src | paste -sd:)
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache_speed}
SHAPE=${SHAPE:-qwen3_5-0.8b}
mkdir -p "$OUT"
rm -rf "$TRITON_CACHE_DIR"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/device.txt"
for run in cold warm; do
  started=$(date +%s)
  timeout "${STEP_S:-330}" python3 benchmarks/model_step.py --out "$OUT/$run" --shapes "$SHAPE" --seq-lens 8192 \
    --variants cp_models --reps 5 2>&1 | grep -E "^\||built"
  echo "$run process: $(( $(date +%s) - started )) s in all"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['rows'][0]; print('$run first step s:', r.get('first_step_s'), 'ms:', r.get('ms'))" "$OUT/$run/model_step.json"
done
timeout "${SYNCS_S:-120}" python3 benchmarks/host_syncs.py --shapes "$SHAPE" --seq-len 8192 --out "$OUT/syncs" 2>&1 | tail -40
