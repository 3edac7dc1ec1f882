#!/usr/bin/env bash
# The kernel options on the device machine, after Triton 3.7.1 and fla are staged into /tmp/site
# (../shared/gpu/stage-wheels.sh) and `bash benchmarks/gpu_build_kernels.sh start` began building causal-conv1d and
# mamba-ssm for sm_90 on the same machine:
#   bash benchmarks/gpu_kernels.sh all     # one call: starts the build, then both parts below
#   bash benchmarks/gpu_kernels.sh tests   # every GPU test (while nvcc builds)
#   bash benchmarks/gpu_kernels.sh mamba   # waits for the build (wheels and logs to $OUT), installs the wheels; their
#                                          # GPU tests, the recurrent-kernel table
#                                          # (docs/benchmarks/recurrent_kernels.md) and the Nemotron-H model step of
#                                          # ours (fla; causal-conv1d + mamba-ssm) against transformers on its fast path
set -uo pipefail
export PYTHONPATH=/tmp/site:$(ls -d "$PWD"/packages/*/src | paste -sd:)
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PART=${1:-}
if [ "$PART" = all ]; then
  bash benchmarks/gpu_build_kernels.sh start
  bash "$0" tests
  PART=mamba
fi
case "$PART" in
  tests)
    timeout "${TESTS_S:-330}" bash benchmarks/gpu_tests.sh
    tail -3 /tmp/kernel_build/build.log 2>/dev/null
    ;;
  mamba)
    WAIT_S=${WAIT_S:-200} COPY_WHEELS=${COPY_WHEELS:-0} bash benchmarks/gpu_build_kernels.sh collect | tail -12
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/kernel_build/wheels/*.whl \
      || exit 1
    python3 -c "import mamba_ssm, causal_conv1d; print('mamba_ssm', mamba_ssm.__version__, 'causal_conv1d', causal_conv1d.__version__)"
    timeout "${MTESTS_S:-150}" python3 -m pytest -m gpu -p no:cacheprovider -q -rfEs packages/cp-core/tests/test_core_mamba_ssm_gpu.py \
      "packages/cp-models/tests/test_models_nemotron_h_gpu.py::test_fast_kernels_match_torch_path" 2>&1 \
      | tee "$OUT/mamba_tests.log" | tail -15
    timeout "${KERNELS_S:-150}" python3 benchmarks/recurrent_kernels.py --out "$OUT" --torch-max-len 8192 2>&1 | grep -E "^\||Error" 
    timeout "${STEP_S:-200}" python3 benchmarks/model_step.py --out "$OUT" --shapes nemotron_h-nano-8l \
      --seq-lens 8192 32768 --reps 3 --limit-s 60 \
      --variants cp_models "cp_models + mamba-ssm" transformers "transformers + grad. ckpt" 2>&1 | grep -E "^\||built|fast path"
    ;;
  *) echo "usage: $0 tests|mamba" >&2; exit 2 ;;
esac
