#!/usr/bin/env bash
# Stage Triton 3.7.1 and fla for the GPU machine in ONE device call (../shared/gpu/stage-wheels.sh takes four).
#
# The Triton wheel ships libtriton.so with its debug info (460 MB unpacked) and parts no CUDA training run loads:
# the AMD backend, CUPTI and proton (profiling), and the Blackwell ptxas. Without them and with the library stripped,
# the xz archive plus fla is about 53 MB, under the 64 MiB one call carries. Writes the ignored folder .gpu/one and
# prints the call. Needs pip, binutils' strip and xz here.
#
# Run from the project's root:   bash benchmarks/gpu_stage_slim.sh [extra-requirement ...]
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
mkdir -p .gpu/dl
ls .gpu/dl/triton-3.7.1-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps "${plat[@]}" -d .gpu/dl triton==3.7.1
rm -rf .gpu/one .gpu/slim && mkdir -p .gpu/one .gpu/slim
python3 -m pip download -q --no-deps "${plat[@]}" -d .gpu/one flash-linear-attention==0.6.0 fla-core==0.6.0 "$@"
python3 -m zipfile -e "$(ls .gpu/dl/triton-3.7.1-*.whl)" .gpu/slim
cd .gpu/slim
rm -rf triton/backends/amd triton/backends/nvidia/lib/cupti triton/backends/nvidia/bin/ptxas-blackwell \
  triton/_C/libproton*
sed -i '/amd/d' triton-3.7.1.dist-info/entry_points.txt
strip --strip-unneeded triton/_C/libtriton.so
chmod +x triton/backends/nvidia/bin/* # zipfile drops the mode bits
tar cf - triton triton-3.7.1.dist-info | xz -9e -T0 > ../one/triton.tar.xz
cd "$root" && rm -rf .gpu/slim
cat > .gpu/one/stage.sh <<'EOF'
# unpack the slim Triton 3.7.1 and install fla (and any extra wheels) into /tmp/site
set -e
mkdir -p /tmp/site
xz -dc -T0 .gpu/one/triton.tar.xz | tar xf - -C /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/one/*.whl
PYTHONPATH=/tmp/site python3 -c "import triton, fla; print('staged triton', triton.__version__, 'fla', fla.__version__)"
EOF
size=$(du -sb .gpu/one | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
echo "staged: .gpu/one is $((size / 1048576)) MiB, the tracked tree $((tree / 1048576)) MiB (one call carries 64 MiB)"
cat <<'MSG'
One GPU call, carry [".gpu/one"]:
  bash .gpu/one/stage.sh && <the work, e.g. bash benchmarks/gpu_speed_goals.sh kernels>
gpu_speed_goals.sh and gpu_speed.sh set PYTHONPATH=/tmp/site themselves. A later call on the same warm machine
finds /tmp/site in place; a cold one needs the staging again.
MSG
