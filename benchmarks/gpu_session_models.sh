#!/usr/bin/env bash
# GPU tests and measurements for cp-models and the performance docs, run on the device machine after Triton 3.7.1
# and fla are staged into /tmp/site (see ../shared/gpu/stage-wheels.sh). One part per call, each inside a 10-minute command:
#   bash benchmarks/gpu_session_models.sh tests     # kernel agreement tests, recurrent kernel choice, vision CP, loss/MoE memory
#   bash benchmarks/gpu_session_models.sh layer     # loss/MoE memory alone; Mamba-2 layer speed of both CP strategies
#   bash benchmarks/gpu_session_models.sh profile   # torch.profiler tables of the Mamba-2 layer (state passing vs a2a)
#   bash benchmarks/gpu_session_models.sh nemotron  # Nemotron-H Nano 8l step vs transformers; Mamba layer CP speed
#   bash benchmarks/gpu_session_models.sh scale     # simulated CP scale of 0.8B (128k .. 512k, cp 1 .. 8)
#   bash benchmarks/gpu_session_models.sh scale-memory  # per-rank peaks at cp 2..8 (128k, 256k) vs the ideal
#   bash benchmarks/gpu_session_models.sh mlp       # recomputing-MLP GPU test; 2B at 32k / 8k vs transformers
#   bash benchmarks/gpu_session_models.sh mlp-more  # 0.8B / 35B-A3B 8l steps; balanced all-gathered-KV layer time
#   bash benchmarks/gpu_session_models.sh followup  # 256k / cp 4 snapshot; Nemotron-H step; 512k / cp 16 balanced
#   bash benchmarks/gpu_session_models.sh segments  # GDN pre-pass in checkpointed segments: GPU tests, middle-rank peaks
#   bash benchmarks/gpu_session_models.sh segments-long  # Nemotron-H step; 512k / cp 16 and 1M / cp 32 (all-gathered KV)
#   bash benchmarks/gpu_session_models.sh large     # model steps of 2B and 35B-A3B 8l vs transformers
#   bash benchmarks/gpu_session_models.sh moe-vs-hf # 35B-A3B 8l at 32k: act. ckpt and both transformers variants
#   bash benchmarks/gpu_session_models.sh tiled     # tiled loss + MoE combine: GPU tests, parts alone, 0.8B steps
#   POINTS="262144:2 262144:4" bash benchmarks/gpu_session_models.sh scale-time  # peaks and compute time per cp
#   bash benchmarks/gpu_session_models.sh peaks     # allocation sites at the 256k / cp 4 peak; rank 0 at cp 2, 4
#   bash benchmarks/gpu_session_models.sh kvgather  # all-gathered-KV attention: GPU tests, layer time, 0.8B at cp 16 / 64
#   bash benchmarks/gpu_session_models.sh ring      # ring attention: its flash block kernels' test, 0.8B at cp 16 / 32 / 64
#   bash benchmarks/gpu_session_models.sh pending   # ring kernels and fla GDN under CP GPU tests, in one call
#   bash benchmarks/gpu_session_models.sh long-rows # 128k steps of 2B, Nemotron-H Nano 8l, 35B-A3B 8l; row-check time
# Logs and tables land under $OUT. Compilation and autotuning of fla's kernels cost minutes per fresh machine (the
# first step of a new process: ~175 s for a Qwen3.5 model, 8 minutes for the simulated 0.8B at cp 16;
# a lone Mamba layer did not finish in 150 s), so every part leaves the Triton cache (compiled kernels and fla's
# autotuning results) in $OUT/cache/triton-cache.tgz.N, parts of at most 15 MiB (a file coming back may hold 16 MiB,
# and at most 8 files come back per call: keep a part's own outputs few). Copy them to .gpu/cache/ here and carry
# .gpu/cache (alone: the staged wheel parts already fill a call's 64 MiB) in the first work call on a fresh
# machine: every part restores them into ~/.triton/cache, which stays while the machine is warm.
set -uo pipefail
export PYTHONPATH=/tmp/site:$(ls -d "$PWD"/packages/*/src | paste -sd:)
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
versions() { python3 -c "import torch, triton, fla, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__, 'transformers', transformers.__version__)"; }
CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
if ls .gpu/cache/triton-cache.tgz.* >/dev/null 2>&1; then
  mkdir -p "$CACHE_DIR" && cat .gpu/cache/triton-cache.tgz.* | tar xzf - -C "$CACHE_DIR"
fi
save_cache() {  # at most 60 MiB in 15 MiB parts, so that it comes back and can travel in with the next carry
  [ "${SAVE_CACHE:-1}" = 1 ] || return 0  # SAVE_CACHE=0: a call whose own outputs need the 64 MiB / 8 files back
  tar czf /tmp/triton-cache.tgz -C "$CACHE_DIR" . 2>/dev/null || return 0
  if [ "$(stat -c %s /tmp/triton-cache.tgz)" -le $((60 * 2**20)) ]; then
    mkdir -p "$OUT/cache" && split -b 15M -d -a 1 /tmp/triton-cache.tgz "$OUT/cache/triton-cache.tgz."
  fi
}
trap save_cache EXIT
VARIANTS=(cp_models "cp_models + act. ckpt" transformers "transformers + grad. ckpt")
case "${1:-tests}" in
  tests)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
    versions | tee -a "$OUT/device.txt"
    timeout 330 python3 -m pytest -v -s -p no:cacheprovider --durations=0 \
      packages/cp-models/tests/test_models_qwen35_gpu.py packages/cp-models/tests/test_models_nemotron_h_gpu.py \
      2>&1 | tee "$OUT/models_gpu_tests.log" | grep -E "PASS|FAIL|ERROR|rel|moe|norm|loss|passed|failed|s call"
    timeout 150 python3 benchmarks/recurrent_kernels.py --out "$OUT" 2>&1 | tail -20
    timeout 100 python3 benchmarks/vision_cp.py --out "$OUT" 2>&1 | tail -14
    timeout 100 python3 benchmarks/loss_moe_memory.py --out "$OUT" 2>&1 | tail -9  # planner parts alone (no fla)
    ;;
  layer)
    versions | tee "$OUT/device.txt"
    mkdir -p "$OUT/layer"
    timeout 90 python3 benchmarks/loss_moe_memory.py --out "$OUT" 2>&1 | tail -9
    timeout 460 python3 benchmarks/nemotron_mamba_cp.py speed --out "$OUT/layer" --reps 3 2>&1 | tee "$OUT/layer/log.txt" | tail -26
    ;;
  profile)  # where state passing's extra per-token time goes (docs/benchmarks/nemotron_mamba_cp_speed.md)
    mkdir -p "$OUT/layer"
    timeout 400 python3 benchmarks/nemotron_mamba_cp.py speed --profile 32768 --out "$OUT/layer" 2>&1 | tail -40
    ;;
  nemotron)
    versions | tee "$OUT/device.txt"
    mkdir -p "$OUT/nemotron" "$OUT/layer"
    timeout 150 python3 benchmarks/nemotron_mamba_cp.py speed --out "$OUT/layer" --reps 3 2>&1 | tee "$OUT/layer/log.txt" | tail -4
    timeout 380 python3 benchmarks/model_step.py --out "$OUT/nemotron" --shapes nemotron_h-nano-8l \
      --seq-lens 8192 32768 --limit-s 90 --first-step-limit-s 240 --variants "${VARIANTS[@]}" 2>&1 | tee "$OUT/nemotron/log.txt" | grep -E "^\||built"
    ;;
  scale)
    mkdir -p "$OUT/scale"
    timeout 560 python3 benchmarks/simulated_scale.py --out "$OUT/scale" --shape qwen3_5-0.8b --limit-s 150 \
      --points 131072:1 131072:2 131072:4 131072:8 262144:8 524288:8 \
      2>&1 | tee "$OUT/scale/log.txt" | grep -E "^\||^\{"
    ;;
  scale-memory)  # per-rank peaks at cp 2..8 only (the ideal from the recorded cp = 1 peaks); loss/MoE parts first
    mkdir -p "$OUT/scale"
    timeout 60 python3 benchmarks/loss_moe_memory.py --out "$OUT" 2>&1 | tail -9
    timeout "${SCALE_S:-380}" python3 benchmarks/simulated_scale.py --out "$OUT/scale" --shape qwen3_5-0.8b \
      --limit-s 150 --memory-only --warmup-tokens 4096 --baseline docs/benchmarks/simulated_scale_qwen3_5-0.8b.json \
      --points 262144:2 262144:4 131072:8 262144:8 2>&1 | tee "$OUT/scale/log.txt" | grep -E "^\||^\{"
    ;;
  tiled)  # the tiled loss and the weighted MoE combine: their GPU tests, the parts alone, 0.8B steps at 8k / 32k
    versions | tee "$OUT/device.txt"
    mkdir -p "$OUT/step"
    timeout 150 python3 -m pytest -q -s -p no:cacheprovider packages/cp-models/tests/test_models_qwen35_gpu.py \
      packages/cp-models/tests/test_models_nemotron_h_gpu.py -k "loss or moe" 2>&1 | tee "$OUT/tiled_tests.log" | grep -E "loss|moe|passed|failed|Error"
    timeout 120 python3 benchmarks/loss_moe_memory.py --out "$OUT" 2>&1 | tail -9
    timeout 300 python3 benchmarks/model_step.py --out "$OUT/step" --shapes qwen3_5-0.8b --seq-lens 8192 32768 \
      --limit-s 60 --first-step-limit-s 240 --reps 2 --variants cp_models "cp_models + act. ckpt" 2>&1 | tee "$OUT/step/log.txt" | grep -E "^\||built"
    ;;
  scale-time)  # per-rank peak and compute time at cp 1..8 (bytes from the planner's closed forms); POINTS to override
    mkdir -p "$OUT/scale"
    timeout "${SCALE_S:-560}" python3 benchmarks/simulated_scale.py --out "$OUT/scale" --shape qwen3_5-0.8b \
      --limit-s 150 --planned-bytes --warmup-tokens 4096 --points ${POINTS:-131072:1 131072:2 131072:4 131072:8} \
      2>&1 | tee "$OUT/scale/log.txt" | grep -E "^\||^\{"
    ;;
  peaks)  # where the 256k / cp 4 peak sits (blocks alive at the peak, by allocating site); cp 2's busiest rank (0)
    mkdir -p "$OUT/peaks" "$OUT/first"
    timeout 300 python3 benchmarks/simulated_scale.py --out "$OUT/peaks" --shape qwen3_5-0.8b --limit-s 150 \
      --memory-only --warmup-tokens 4096 --snapshot 500000 --points 131072:2 262144:4 2>&1 | tee "$OUT/peaks/log.txt" | grep -E "^\|"
    timeout 250 python3 benchmarks/simulated_scale.py --out "$OUT/first" --shape qwen3_5-0.8b --limit-s 150 \
      --memory-only --warmup-tokens 4096 --rank first --points 262144:2 262144:4 2>&1 | tee "$OUT/first/log.txt" | grep -E "^\|"
    ;;
  kvgather)  # cp-core's GPU attention tests (bottom-right alignment); one layer's time per rank; 0.8B past cp 8
    versions | tee "$OUT/device.txt"
    mkdir -p "$OUT/kv"
    timeout 120 python3 -m pytest -q -p no:cacheprovider packages/cp-core/tests/test_core_attention_gpu.py 2>&1 \
      | tee "$OUT/kv/attention_gpu_tests.log" | tail -3
    timeout 150 python3 benchmarks/attention_cp_time.py --out "$OUT/kv/attention_cp_time.md" --reps 1 \
      --seq-lens 131072 524288 --cps 8 16 64 2>&1 | tee "$OUT/kv/attention_time.log" | grep -E "^\|"
    timeout "${SCALE_S:-300}" python3 benchmarks/simulated_scale.py --out "$OUT/kv" --shape qwen3_5-0.8b --limit-s 150 \
      --planned-bytes --warmup-tokens 4096 --baseline docs/benchmarks/simulated_scale_qwen3_5-0.8b.json \
      --points ${POINTS:-524288:16 1048576:64 2097152:64 1048576:16} 2>&1 | tee "$OUT/kv/log.txt" | grep -E "^\||^\{"
    ;;
  mlp)  # the MLPs that recompute their activation: GPU test; 2B at 32k / 8k vs transformers in the same run
    versions | tee "$OUT/device.txt"
    mkdir -p "$OUT/mlp"
    timeout 60 python3 -m pytest -q -p no:cacheprovider packages/cp-models/tests/test_models_mlp.py 2>&1 \
      | tee "$OUT/mlp/mlp_tests.log" | tail -3
    timeout "${STEP_S:-500}" python3 benchmarks/model_step.py --out "$OUT/mlp" --shapes qwen3_5-2b --seq-lens 32768 8192 \
      --limit-s 60 --first-step-limit-s 240 --reps 2 --variants cp_models "cp_models + act. ckpt" \
      "transformers + grad. ckpt" 2>&1 | tee "$OUT/mlp/log.txt" | grep -E "^\||built"
    ;;
  mlp-more)  # 0.8B and 35B-A3B 8l steps with the recomputing MLPs; balanced all-gathered-KV attention time
    mkdir -p "$OUT/mlp2" "$OUT/kv"
    timeout "${STEP_S:-330}" python3 benchmarks/model_step.py --out "$OUT/mlp2" --shapes qwen3_5-0.8b \
      qwen3_5-35b-a3b-8l --seq-lens 32768 8192 --limit-s 60 --first-step-limit-s 200 --reps 2 \
      --variants cp_models "cp_models + act. ckpt" 2>&1 | tee "$OUT/mlp2/log.txt" | grep -E "^\||built"
    timeout "${ATTN_S:-200}" python3 benchmarks/attention_cp_time.py --out "$OUT/kv/attention_cp_time.md" --reps 1 \
      --seq-lens 131072 524288 --cps 8 16 64 2>&1 | tee "$OUT/kv/attention_time.log" | grep -E "^\|"
    ;;
  followup)  # the 256k / cp 4 peak's allocation sites (snapshot, early stop off); the
    # Nemotron-H step with its recomputing MLP; a simulated 512k / cp 16 step with balanced all-gathered KV
    versions | tee "$OUT/device.txt"
    mkdir -p "$OUT/peaks" "$OUT/nemotron" "$OUT/kv"
    timeout 200 python3 benchmarks/simulated_scale.py --out "$OUT/peaks" --shape qwen3_5-0.8b --limit-s 150 \
      --memory-only --warmup-tokens 4096 --snapshot 500000 --points 262144:4 2>&1 | tee "$OUT/peaks/log.txt" | grep -E "^\|"
    timeout 200 python3 benchmarks/model_step.py --out "$OUT/nemotron" --shapes nemotron_h-nano-8l --seq-lens 32768 8192 \
      --limit-s 60 --first-step-limit-s 150 --reps 2 --variants cp_models "cp_models + act. ckpt" 2>&1 \
      | tee "$OUT/nemotron/log.txt" | grep -E "^\||built"
    timeout "${SCALE_S:-180}" python3 benchmarks/simulated_scale.py --out "$OUT/kv" --shape qwen3_5-0.8b --limit-s 150 \
      --planned-bytes --warmup-tokens 4096 --baseline docs/benchmarks/simulated_scale_qwen3_5-0.8b.json \
      --points ${POINTS:-524288:16} 2>&1 | tee "$OUT/kv/log.txt" | grep -E "^\||^\{"
    ;;
  segments)  # GDN's pre-pass in checkpointed segments: its kernel tests, then the middle-rank points it changes
    versions | tee "$OUT/device.txt"
    mkdir -p "$OUT/seg"
    # the pre-pass tests first (the others compile kernels for shapes the model does not use: minutes when cold)
    timeout 200 python3 -m pytest -v -s -p no:cacheprovider packages/cp-core/tests/test_core_recurrent_gpu.py \
      -k "segmented or cp_gdn or identity" 2>&1 | tee "$OUT/seg/tests.log" | grep -E "PASS|FAIL|ERROR|segmented|cp gdn|kept|passed|failed"
    timeout "${SCALE_S:-360}" python3 benchmarks/simulated_scale.py --out "$OUT/seg" --shape qwen3_5-0.8b --limit-s 150 \
      --planned-bytes --warmup-tokens 4096 --baseline docs/benchmarks/simulated_scale_qwen3_5-0.8b.json \
      --points ${POINTS:-262144:4 131072:4 262144:8 131072:8} 2>&1 | tee "$OUT/seg/log.txt" | grep -E "^\||^\{"
    ;;
  segments-long)  # the Nemotron-H step with its recomputing MLP; long rows past Ulysses' head limit
    mkdir -p "$OUT/nemotron" "$OUT/kv"
    timeout 200 python3 benchmarks/model_step.py --out "$OUT/nemotron" --shapes nemotron_h-nano-8l --seq-lens 32768 8192 \
      --limit-s 60 --first-step-limit-s 150 --reps 2 --variants cp_models "cp_models + act. ckpt" 2>&1 \
      | tee "$OUT/nemotron/log.txt" | grep -E "^\||built"
    timeout "${SCALE_S:-380}" python3 benchmarks/simulated_scale.py --out "$OUT/kv" --shape qwen3_5-0.8b --limit-s 150 \
      --planned-bytes --warmup-tokens 4096 --baseline docs/benchmarks/simulated_scale_qwen3_5-0.8b.json \
      --points ${POINTS:-524288:16 1048576:32} 2>&1 | tee "$OUT/kv/log.txt" | grep -E "^\||^\{"
    ;;
  ring)  # K|V blocks around the ring (kv_ring): the flash block kernels against the reference, then the long rows
    # past Ulysses' head limit (all-gathered KV holds them at 0.955 / 1.26 / 1.63x the ideal)
    versions | tee "$OUT/device.txt"
    mkdir -p "$OUT/ring"
    timeout 150 python3 -m pytest -v -p no:cacheprovider packages/cp-core/tests/test_core_attention_gpu.py -k ring \
      2>&1 | tee "$OUT/ring/tests.log" | grep -E "PASS|FAIL|ERROR|passed|failed"
    timeout "${SCALE_S:-420}" python3 benchmarks/simulated_scale.py --out "$OUT/ring" --shape qwen3_5-0.8b --limit-s 150 \
      --attention-cp kv_ring --planned-bytes --warmup-tokens 4096 \
      --baseline docs/benchmarks/simulated_scale_qwen3_5-0.8b.json --points ${POINTS:-524288:16 1048576:32 2097152:64} \
      2>&1 | tee "$OUT/ring/log.txt" | grep -E "^\||^\{"
    ;;
  pending)  # in one call: the ring's fast kernels, fla GDN rank 0 under CP bitwise equal to the local run and no rank
    # keeping the conv output
    versions | tee "$OUT/device.txt"
    mkdir -p "$OUT/pending"
    timeout 420 python3 -m pytest -v -p no:cacheprovider packages/cp-core/tests/test_core_attention_gpu.py \
      packages/cp-core/tests/test_core_recurrent_gpu.py -k "ring or cp_gdn_fla_rank0 or prepass_keeps_no_conv" 2>&1 \
      | tee "$OUT/pending/tests.log" | grep -E "PASS|FAIL|ERROR|passed|failed"
    ;;
  long-rows)  # 128k rows of the shapes only measured to 32k (checkpointed: the only variant that fits); the time of
    # the per-row input checks (two host syncs per forward)
    mkdir -p "$OUT/long" "$OUT/checks"
    timeout 60 python3 benchmarks/row_checks_time.py --out "$OUT/checks" 2>&1 | tail -6
    timeout "${STEP_S:-500}" python3 benchmarks/model_step.py --out "$OUT/long" --shapes qwen3_5-2b nemotron_h-nano-8l \
      qwen3_5-35b-a3b-8l --seq-lens 131072 --limit-s 90 --first-step-limit-s 200 --reps 1 \
      --variants "cp_models + act. ckpt" 2>&1 | tee "$OUT/long/log.txt" | grep -E "^\||built"
    ;;
  large)
    mkdir -p "$OUT/large"
    timeout 560 python3 benchmarks/model_step.py --out "$OUT/large" --shapes qwen3_5-2b qwen3_5-35b-a3b-8l \
      --seq-lens 8192 32768 --limit-s 60 --first-step-limit-s 240 --reps 2 --variants "${VARIANTS[@]}" 2>&1 | tee "$OUT/large/log.txt" | grep -E "^\||built"
    ;;
  moe-vs-hf)  # cp_models (no ckpt) at 32k is recorded in docs/benchmarks/model_step.json; the rest of the comparison
    mkdir -p "$OUT/large"
    timeout 570 python3 benchmarks/model_step.py --out "$OUT/large" --shapes qwen3_5-35b-a3b-8l --seq-lens 32768 \
      --limit-s 60 --first-step-limit-s 240 --reps 2 --variants "cp_models + act. ckpt" transformers \
      "transformers + grad. ckpt" 2>&1 | tee "$OUT/large/log.txt" | grep -E "^\||built"
    ;;
esac
