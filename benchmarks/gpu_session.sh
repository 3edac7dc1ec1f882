#!/usr/bin/env bash
# cp-core GPU tests and kernel measurements, run on the device machine after Triton 3.7.1 and fla are staged into
# /tmp/site (see ../shared/gpu/stage-wheels.sh). Writes logs and tables under $OUT.
set -uo pipefail
export PYTHONPATH=/tmp/site:$(ls -d "$PWD"/packages/*/src | paste -sd:)
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)" | tee -a "$OUT/device.txt"
python3 -m pytest -q -s -p no:cacheprovider packages/cp-core/tests/test_core_attention_gpu.py \
  packages/cp-core/tests/test_core_recurrent_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
python3 benchmarks/recurrent_cp.py speed --out "$OUT/recurrent_speed.json" 2>&1 | tee "$OUT/speed.log"
