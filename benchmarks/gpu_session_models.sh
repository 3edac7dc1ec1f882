#!/usr/bin/env bash
# GPU session for cp-models (after staging Triton 3.7.1 and fla into /tmp/site): kernel agreement in the full
# model, then the Qwen3.5-0.8B step benchmark against transformers. Results under $OUT.
set -uo pipefail
export PYTHONPATH=/tmp/site:$(ls -d "$PWD"/packages/*/src | paste -sd:)
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pytest -q -s -p no:cacheprovider packages/cp-models/tests/test_models_qwen35_gpu.py 2>&1 | tee "$OUT/models_gpu_tests.log" | tail -5
python3 benchmarks/qwen35_step.py --out "$OUT" 2>&1 | tee "$OUT/qwen35_step.log" | tail -14
