#!/usr/bin/env bash
# GPU session for cp-models and cp-vlm, run on the device machine after Triton 3.7.1 and fla are staged into
# /tmp/site (see ../shared/gpu/stage-wheels.sh). One part per call, so each fits a 10-minute command:
#   bash benchmarks/gpu_session_models.sh tests    # kernel agreement tests, SSD kernel choice, vision CP
#   bash benchmarks/gpu_session_models.sh qwen35   # Qwen3.5-0.8B step vs transformers, same process
#   bash benchmarks/gpu_session_models.sh nemotron # Nemotron-H Mamba layer shares and model vs transformers
#   bash benchmarks/gpu_session_models.sh long     # Qwen3.5-0.8B with activation checkpointing at 128k and 256k
# Logs and tables land under $OUT.
set -uo pipefail
export PYTHONPATH=/tmp/site:$(ls -d "$PWD"/packages/*/src | paste -sd:)
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
case "${1:-tests}" in
  tests)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
    python3 -c "import torch, triton, fla, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
    timeout 330 python3 -m pytest -v -s -p no:cacheprovider --durations=0 \
      packages/cp-models/tests/test_models_qwen35_gpu.py packages/cp-models/tests/test_models_nemotron_h_gpu.py \
      2>&1 | tee "$OUT/models_gpu_tests.log" | grep -E "PASS|FAIL|ERROR|rel|moe|norm|loss|passed|failed|s call"
    timeout 120 python3 benchmarks/ssd_kernels.py --out "$OUT" 2>&1 | tail -12
    timeout 100 python3 benchmarks/vision_cp.py --out "$OUT" 2>&1 | tail -14
    ;;
  qwen35)
    timeout 560 python3 benchmarks/qwen35_step.py --out "$OUT" --seq-lens 8192 32768 \
      --variants cp_models "cp_models + act. ckpt" transformers "transformers + grad. ckpt" 2>&1 | tee "$OUT/qwen35_step.log" | tail -14
    ;;
  nemotron)
    timeout 560 python3 benchmarks/nemotron_mamba_cp.py speed --out "$OUT" --reps 3 2>&1 | tee "$OUT/nemotron_speed.log" | tail -30
    ;;
  rerun)  # the GPU tests alone, then the Qwen3.5 step and the Nemotron-H speed, each with its own time limit
    timeout 270 python3 -m pytest -v -s -p no:cacheprovider --durations=0 \
      packages/cp-models/tests/test_models_nemotron_h_gpu.py "packages/cp-models/tests/test_models_qwen35_gpu.py::test_moe_grouped_gemm_matches_loop" \
      2>&1 | tee "$OUT/models_gpu_tests2.log" | grep -E "PASS|FAIL|ERROR|rel|moe|kernel_agreement|passed|failed|s call"
    ;;
  steps)
    timeout 330 python3 benchmarks/qwen35_step.py --out "$OUT" --seq-lens 8192 32768 \
      --variants cp_models "cp_models + act. ckpt" transformers "transformers + grad. ckpt" 2>&1 | tee "$OUT/qwen35_step.log" | tail -12
    timeout 230 python3 benchmarks/nemotron_mamba_cp.py speed --out "$OUT" --reps 3 2>&1 | tee "$OUT/nemotron_speed.log" | tail -24
    ;;
  long)
    mkdir -p "$OUT/long"
    timeout 560 python3 benchmarks/qwen35_step.py --out "$OUT/long" --seq-lens 131072 262144 \
      --variants "cp_models + act. ckpt" 2>&1 | tee "$OUT/long/qwen35_long.log" | tail -8
    ;;
esac
