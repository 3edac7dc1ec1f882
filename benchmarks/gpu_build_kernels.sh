#!/usr/bin/env bash
# Build causal-conv1d and mamba-ssm wheels for Hopper (sm_90 only) on the device machine, from their sdists
# (downloaded here with `python3 benchmarks/gpu_build_kernels.sh fetch`, which writes the ignored folder .gpu/src).
#   bash benchmarks/gpu_build_kernels.sh start    # on the device machine: builds in the background (setsid), so
#                                                 # other calls can use the GPU while nvcc runs on the CPU cores
#   bash benchmarks/gpu_build_kernels.sh collect  # waits for the build, then copies the build logs and (unless
#                                                 # COPY_WHEELS=0) the wheels, split into parts under 15 MiB, to $OUT
# Both packages compile every architecture from sm_75 to sm_121 by default; the build keeps only sm_90 (H100/H200),
# which cuts nvcc's work about eightfold. A user with a normal CUDA box installs them with
# `uv sync --all-packages --extra mamba` (prebuilt wheels where their index has one for the torch in use).
set -uo pipefail
OUT=${OUT:-/tmp/out}
BUILD=/tmp/kernel_build
case "${1:-}" in
  fetch)
    mkdir -p .gpu/src
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
    python3 - <<'PY'  # the sdists straight from PyPI: pip would try to build their metadata, which needs torch
import json, urllib.request
for name, version in [("causal-conv1d", "1.7.0"), ("mamba-ssm", "2.3.2.post1")]:
    for f in json.load(urllib.request.urlopen(f"https://pypi.org/pypi/{name}/json"))["releases"][version]:
        if f["packagetype"] == "sdist":
            urllib.request.urlretrieve(f["url"], f".gpu/src/{f['filename']}")
PY
    ls -la .gpu/src
    ;;
  start)
    rm -f "$BUILD/done"  # collect waits on this marker: a stale one from an earlier build must not satisfy it
    mkdir -p "$BUILD/wheels"
    for sdist in .gpu/src/*.tar.gz; do tar xzf "$sdist" -C "$BUILD"; done
    # keep only the sm_90 gencode pair in each setup.py
    for setup in "$BUILD"/*/setup.py; do
      python3 - "$setup" <<'PY'
import re, sys
path = sys.argv[1]
lines = open(path).read().split("\n")
out, skip_next = [], False
for i, line in enumerate(lines):
    if line.strip() == 'cc_flag.append("-gencode")' and i + 1 < len(lines):
        nxt = lines[i + 1]
        if "arch=compute_" in nxt and "arch=compute_90," not in nxt:
            skip_next = True
            out.append(line[: len(line) - len(line.lstrip())] + "pass")  # keeps every if-block non-empty
            continue
    if skip_next:
        skip_next = False
        continue
    out.append(line)
open(path, "w").write("\n".join(out))
compile("\n".join(out), path, "exec")
print(path, "gencodes left:", re.findall(r"arch=compute_\d+,code=sm_\d+", "\n".join(out)))
PY
    done
    cat > "$BUILD/build.sh" <<'SH'
set -x
cd /tmp/kernel_build
# ninja (staged into /tmp/site with the other wheels) lets torch's extension builder compile files in parallel;
# without it setuptools compiles them one after another. The two packages build side by side on the 16 cores.
export PATH=/tmp/site/bin:$PATH TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=8
export CAUSAL_CONV1D_FORCE_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE
nvcc --version | tail -2
ninja --version || echo "ninja missing: files compile one at a time"
build() {
  python3 -m pip wheel -v --no-deps --no-build-isolation -w wheels "$1"-*/ > "$1.log" 2>&1
  echo "$1 exit $?"
}
build causal_conv1d &
build mamba_ssm &
wait
ls -la wheels
touch done
SH
    setsid nohup bash "$BUILD/build.sh" > "$BUILD/build.log" 2>&1 < /dev/null &
    echo "build started in the background: $BUILD/build.log"
    ;;
  collect)
    mkdir -p "$OUT"
    deadline=$(( $(date +%s) + ${WAIT_S:-400} ))
    until [ -f "$BUILD/done" ] || [ "$(date +%s)" -ge "$deadline" ]; do sleep 5; done
    cat "$BUILD/build.log"
    (cd "$BUILD" && tar czf "$OUT/kernel_build_logs.tgz" build.log causal_conv1d.log mamba_ssm.log 2>/dev/null)
    [ "${COPY_WHEELS:-1}" = 1 ] || { ls -la "$BUILD"/wheels; exit 0; }  # a call brings back at most 8 files
    for whl in "$BUILD"/wheels/*.whl; do
      [ -f "$whl" ] || continue
      split -b 15000000 -d -a 1 "$whl" "$OUT/$(basename "$whl").part."
    done
    ls -la "$OUT"
    ;;
  *) echo "usage: $0 fetch|start|collect" >&2; exit 2 ;;
esac
