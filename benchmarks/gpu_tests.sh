#!/usr/bin/env bash
# Every GPU test of every package (the tests marked `gpu`: fast kernels against their torch references, in bf16
# with the tolerances each test states), in one pytest run on the device machine, after Triton 3.7.1 and fla are
# staged into /tmp/site (../shared/gpu/stage-wheels.sh). Prints pytest's summary; the log lands in $OUT.
#   bash benchmarks/gpu_tests.sh [pytest args, e.g. -k ring]
# On a CUDA box with the project's environment: `uv sync --all-packages --extra fla --group test` (or
# `pip install -e packages/cp-core[fla] ...`), then `uv run pytest -m gpu packages/*/tests`.
# A cold machine compiles and autotunes fla's kernels first: allow several minutes.
set -uo pipefail
export PYTHONPATH=/tmp/site:$(ls -d "$PWD"/packages/*/src | paste -sd:)
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pytest -m gpu -p no:cacheprovider -q -rfEs --durations=10 packages/*/tests "$@" 2>&1 | tee "$OUT/gpu_tests.log"
