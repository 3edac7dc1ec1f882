#!/usr/bin/env bash
# The speed goals' measurements (docs/performance.md), one part per device call, on a machine where Triton 3.7.1
# and fla are staged into /tmp/site (../shared/gpu/stage-wheels.sh, or benchmarks/gpu_stage_slim.sh's archive
# unpacked at the start of the same call). Each part tars its results into $OUT/<part>.tgz (a call brings back only
# a few files):
#   bash benchmarks/gpu_speed_goals.sh step8k  # 0.8B at 8k: ours (both loss tile kernels), transformers, act. ckpt in
#                                              # one process; with graphed norms/MLPs, and with them compiled as
#                                              # CUDA graphs; the profile of ours; the loss alone
#   bash benchmarks/gpu_speed_goals.sh first   # first step of a fresh process, cold and warm (gpu_speed.sh SHIPPED=1);
#                                              # the GPU tests of the loss tiles, the fused SwiGLU and GatedDecay
#   bash benchmarks/gpu_speed_goals.sh kernels # with an empty Triton cache: ours' cold first step, then ours,
#                                              # checkpointed ours and transformers at 8k in that process; the GPU
#                                              # tests of our kernels; ours' warm first step; the profile of ours
#   bash benchmarks/gpu_speed_goals.sh long    # MFU at 32k (0.8B, 2B) and at 128k with checkpointing (2B); the
#                                              # profile of ours at 32k (0.8B)
set -uo pipefail
export PYTHONPATH=/tmp/site:$(ls -d "$PWD"/packages/*/src | paste -sd:)
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
part=${1:-step8k}
res=/tmp/results/$part
mkdir -p "$res"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, fla, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__, 'transformers', transformers.__version__)"
} | tee "$res/device.txt"
case "$part" in
  step8k)
    timeout "${STEP_S:-330}" python3 benchmarks/model_step.py --out "$res/step" --shapes qwen3_5-0.8b --seq-lens 8192 \
      --reps 7 --limit-s 60 --first-step-limit-s 150 \
      --variants cp_models "cp_models + torch loss tiles" transformers "cp_models + act. ckpt" 2>&1 \
      | tee "$res/step.log" | grep -E "^\||built"
    timeout "${GRAPHED_S:-100}" python3 benchmarks/model_step.py --out "$res/graphed" --shapes qwen3_5-0.8b \
      --seq-lens 8192 --reps 7 --limit-s 60 --variants "cp_models + graphed norms/MLP" 2>&1 \
      | tee "$res/graphed.log" | grep -E "^\||built|Error"
    timeout "${COMPILED_S:-150}" python3 benchmarks/model_step.py --out "$res/compiled" --shapes qwen3_5-0.8b \
      --seq-lens 8192 --reps 7 --limit-s 60 --first-step-limit-s 120 \
      --variants "cp_models + compiled norms/MLP (CUDA graphs)" 2>&1 | tee "$res/compiled.log" | grep -E "^\||built|Error"
    timeout "${PROFILE_S:-90}" python3 benchmarks/profile_qwen35.py --seq-len 8192 --variants ours --out "$res/profile" \
      2>&1 | tee "$res/profile.log" | tail -16
    timeout "${LOSS_S:-60}" python3 benchmarks/loss_moe_memory.py --tokens 8192 --tile-kernels torch triton \
      --out "$res/loss" 2>&1 | tail -8
    ;;
  first)
    SHIPPED=1 OUT=$res bash benchmarks/gpu_speed.sh 2>&1 | tee "$res/log.txt"
    timeout "${TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider -rfEs \
      packages/cp-models/tests/test_models_qwen35_gpu.py::test_tiled_loss_bf16_on_cuda \
      packages/cp-models/tests/test_models_mlp.py \
      packages/cp-core/tests/test_core_recurrent_gpu.py::test_gated_decay_in_fla_kernel_matches_torch 2>&1 \
      | tee "$res/tests.log" | tail -6
    ;;
  kernels)  # a fresh Triton cache: ours' first step (cold), then ours, checkpointed ours and transformers at 8k in that
            # process; the GPU tests of our kernels; the profile of ours
    export TRITON_CACHE_DIR=/tmp/triton_kernels
    timeout "${STEP_S:-260}" python3 benchmarks/model_step.py --out "$res/step" \
      --shapes qwen3_5-0.8b --seq-lens 8192 --reps 7 --limit-s 60 --first-step-limit-s 150 \
      --variants cp_models "cp_models + act. ckpt" transformers 2>&1 | tee "$res/step.log" | grep -E "^\||built"
    python3 -c "import json,sys; print('first step s:', json.load(open(sys.argv[1]))['rows'][0].get('first_step_s'))" \
      "$res/step/model_step.json"
    timeout "${TESTS_S:-90}" python3 -m pytest -q -p no:cacheprovider -rfEs \
      packages/cp-models/tests/test_models_qwen35_gpu.py::test_fused_norm_kernels_match_reference \
      packages/cp-models/tests/test_models_mlp.py::test_recomputing_swiglu_on_cuda_bf16_keeps_half_and_matches \
      packages/cp-models/tests/test_models_mlp.py::test_compiled_mlp_with_the_swiglu_kernels_matches_eager \
      packages/cp-models/tests/test_models_qwen35_gpu.py::test_tiled_loss_bf16_on_cuda 2>&1 | tee "$res/tests.log" | tail -4
    # warm: a new process over the Triton cache the runs above filled
    timeout "${WARM_S:-60}" python3 benchmarks/model_step.py --out "$res/warm" \
      --shapes qwen3_5-0.8b --seq-lens 8192 --reps 3 --limit-s 30 --variants cp_models 2>&1 | tee "$res/warm.log" \
      | grep -E "^\||built"
    python3 -c "import json,sys; print('warm first step s:', json.load(open(sys.argv[1]))['rows'][0].get('first_step_s'))" \
      "$res/warm/model_step.json"
    timeout "${PROFILE_S:-90}" python3 benchmarks/profile_qwen35.py --seq-len 8192 --variants ours --out "$res/profile" \
      2>&1 | tee "$res/profile.log" | tail -16
    ;;
  long)
    timeout "${STEP_S:-300}" python3 benchmarks/model_step.py --out "$res/32k" --shapes qwen3_5-0.8b qwen3_5-2b \
      --seq-lens 32768 --reps 3 --limit-s 60 --first-step-limit-s 150 --variants cp_models 2>&1 \
      | tee "$res/32k.log" | grep -E "^\||built"
    timeout "${LONG_S:-240}" python3 benchmarks/model_step.py --out "$res/128k" --shapes qwen3_5-2b --seq-lens 131072 \
      --reps 1 --limit-s 90 --first-step-limit-s 150 --variants "cp_models + act. ckpt" 2>&1 \
      | tee "$res/128k.log" | grep -E "^\||built"
    timeout "${PROFILE_S:-90}" python3 benchmarks/profile_qwen35.py --seq-len 32768 --variants ours \
      --out "$res/profile32k" 2>&1 | tee "$res/profile32k.log" | tail -16
    ;;
  *)
    echo "unknown part $part: step8k, first, kernels or long" >&2
    exit 2
    ;;
esac
mkdir -p "$OUT" && tar czf "$OUT/$part.tgz" -C /tmp/results "$part"
