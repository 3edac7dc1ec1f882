#!/usr/bin/env bash
# The 0.8B step at 8k on the device machine, after Triton 3.7.1 and fla are staged into /tmp/site
# (../shared/gpu/stage-wheels.sh), first steps of fresh processes:
#   1. autotune: empty Triton cache, fla's config files off (FLA_CACHE_MODE=disabled): every candidate config of
#      every fla kernel compiles and is timed; the process then writes fla's choices to $OUT/fla_tuning
#   2. tuned: empty Triton cache, fla reads those choices (CP_FLA_TUNING_DIR): one compile per kernel
#   3. warm: the Triton cache of run 2 (compiled kernels) present
#   bash benchmarks/gpu_speed.sh            # results under $OUT: autotune/ tuned/ warm/ fla_tuning/
#   SYNCS=1 bash benchmarks/gpu_speed.sh    # then where the step makes the host wait (benchmarks/host_syncs.py)
#   SHIPPED=1 bash benchmarks/gpu_speed.sh  # runs 2 and 3 only, fla reading the configs cp_core ships (a user's cold
#                                           # and warm start), results under $OUT: shipped/ warm/
# $OUT/fla_tuning/<GPU name>/fla-<version>/ is what packages/cp-core/src/cp_core/fla_tuning/ ships for that GPU.
set -uo pipefail
export PYTHONPATH=/tmp/site:$(ls -d "$PWD"/packages/*/src | paste -sd:)
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
SHAPE=${SHAPE:-qwen3_5-0.8b}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/device.txt"
first_step() {  # first_step NAME TRITON_CACHE [VAR=VALUE ...] -- [model_step args]
  local name=$1 cache=$2
  shift 2
  local vars=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do vars+=("$1"); shift; done
  shift
  local started=$(date +%s)
  env TRITON_CACHE_DIR="$cache" "${vars[@]}" timeout "${STEP_S:-330}" python3 benchmarks/model_step.py \
    --out "$OUT/$name" --shapes "$SHAPE" --seq-lens 8192 --variants cp_models --reps 5 "$@" 2>&1 \
    | grep -E "^\||fla tuning"
  echo "$name process: $(( $(date +%s) - started )) s in all"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['rows'][0]; print('$name first step s:', r.get('first_step_s'), 'ms:', r.get('ms'))" "$OUT/$name/model_step.json"
}
rm -rf /tmp/triton_autotune /tmp/triton_tuned "$OUT/fla_tuning"
if [ "${SHIPPED:-0}" = 1 ]; then
  first_step shipped /tmp/triton_tuned --
  first_step warm /tmp/triton_tuned --
  exit 0
fi
first_step autotune /tmp/triton_autotune FLA_CACHE_MODE=disabled -- --write-fla-tuning "$OUT/fla_tuning"
first_step tuned /tmp/triton_tuned CP_FLA_TUNING_DIR="$OUT/fla_tuning" --
first_step warm /tmp/triton_tuned CP_FLA_TUNING_DIR="$OUT/fla_tuning" --
if [ "${SYNCS:-0}" = 1 ]; then
  TRITON_CACHE_DIR=/tmp/triton_tuned CP_FLA_TUNING_DIR="$OUT/fla_tuning" timeout "${SYNCS_S:-120}" \
    python3 benchmarks/host_syncs.py --shapes "$SHAPE" --seq-len 8192 --out "$OUT/syncs" 2>&1 | tail -40
fi
