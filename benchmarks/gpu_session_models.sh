#!/usr/bin/env bash
# GPU session for cp-models, cp-vlm and the performance docs, run on the device machine after Triton 3.7.1 and fla
# are staged into /tmp/site (see ../shared/gpu/stage-wheels.sh). One part per call, each inside a 10-minute command:
#   bash benchmarks/gpu_session_models.sh tests     # kernel agreement tests, SSD kernel choice, vision CP
#   bash benchmarks/gpu_session_models.sh small     # Nemotron-H GPU tests; model steps of 0.8B and Nemotron-H Nano 8l
#   bash benchmarks/gpu_session_models.sh scale     # simulated CP scale of 0.8B (incl. 128k and 256k on one GPU); Mamba layer shares
#   bash benchmarks/gpu_session_models.sh large     # model steps of 2B and 35B-A3B 8l
# Logs and tables land under $OUT.
set -uo pipefail
export PYTHONPATH=/tmp/site:$(ls -d "$PWD"/packages/*/src | paste -sd:)
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
versions() { python3 -c "import torch, triton, fla, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__, 'transformers', transformers.__version__)"; }
VARIANTS=(cp_models "cp_models + act. ckpt" transformers "transformers + grad. ckpt")
case "${1:-tests}" in
  tests)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
    versions | tee -a "$OUT/device.txt"
    timeout 330 python3 -m pytest -v -s -p no:cacheprovider --durations=0 \
      packages/cp-models/tests/test_models_qwen35_gpu.py packages/cp-models/tests/test_models_nemotron_h_gpu.py \
      2>&1 | tee "$OUT/models_gpu_tests.log" | grep -E "PASS|FAIL|ERROR|rel|moe|norm|loss|passed|failed|s call"
    timeout 120 python3 benchmarks/ssd_kernels.py --out "$OUT" 2>&1 | tail -12
    timeout 100 python3 benchmarks/vision_cp.py --out "$OUT" 2>&1 | tail -14
    ;;
  small)
    versions | tee "$OUT/device.txt"
    timeout 230 python3 -m pytest -v -s -p no:cacheprovider --durations=0 packages/cp-models/tests/test_models_nemotron_h_gpu.py \
      2>&1 | tee "$OUT/nemotron_gpu_tests.log" | grep -E "PASS|FAIL|ERROR|rel|moe|assert|passed|failed|s call"
    mkdir -p "$OUT/small"
    timeout 330 python3 benchmarks/model_step.py --out "$OUT/small" --shapes qwen3_5-0.8b nemotron_h-nano-8l \
      --seq-lens 8192 32768 --limit-s 60 --variants "${VARIANTS[@]}" 2>&1 | tee "$OUT/small/log.txt" | grep -E "^\||built"
    ;;
  scale)
    mkdir -p "$OUT/scale" "$OUT/layer"
    timeout 380 python3 benchmarks/simulated_scale.py --out "$OUT/scale" --shape qwen3_5-0.8b --limit-s 120 \
      --points 131072:1 131072:2 131072:4 131072:8 262144:1 262144:8 524288:8 1048576:8 2097152:16 \
      2>&1 | tee "$OUT/scale/log.txt" | grep -E "^\||^\{"
    timeout 150 python3 benchmarks/nemotron_mamba_cp.py speed --out "$OUT/layer" --reps 3 2>&1 | tee "$OUT/layer/log.txt" | tail -4
    ;;
  large)
    mkdir -p "$OUT/large"
    timeout 540 python3 benchmarks/model_step.py --out "$OUT/large" --shapes qwen3_5-2b qwen3_5-35b-a3b-8l \
      --seq-lens 8192 32768 --limit-s 60 --variants "${VARIANTS[@]}" 2>&1 | tee "$OUT/large/log.txt" | grep -E "^\||built"
    ;;
esac
