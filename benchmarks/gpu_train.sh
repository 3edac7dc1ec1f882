#!/usr/bin/env bash
# `sft-train` end to end on one GPU of the device machine, after Triton 3.7.1, fla and pydantic are staged into
# /tmp/site (../shared/gpu/stage-wheels.sh pydantic==... pydantic-core==... annotated-types==... typing-inspection==...
# typing-extensions==...: the image lacks pydantic). One part per call, each inside a 10-minute command:
#   bash benchmarks/gpu_train.sh 8k      # 0.8B checkpoint saved by transformers: 8k rows, FSDP2 and not, checkpoint,
#                                        # resume, HF export vs transformers' logits, the model step for comparison
#   bash benchmarks/gpu_train.sh 32k     # 0.8B at 32k (checkpointing, FSDP2, LoRA), the model step; 2B at 32k
#   bash benchmarks/gpu_train.sh more    # Nemotron-H Nano (8 layers) at 32k, the tiny VL preset, 0.8B 32k eager
#   BUDGET_S=540 bash benchmarks/gpu_train.sh final  # on a cold machine: the 0.8B 8k run's cold first step,
#                                        # transformers' logits against ours (float32 reference), Nano 8l at 32k
#   bash benchmarks/gpu_train.sh cold    # the 0.8B 8k run's first step from an empty Triton cache, with the fla
#                                        # kernel configs shipped for the GPU (cp_core/fla_tuning/)
#   bash benchmarks/gpu_train.sh compare # after `final`, alone on the warm machine: the 0.8B 8k run (20 steps)
#                                        # against the model step
# Each run is `torchrun --standalone --nproc-per-node 1 -m sft_trainer.run` (what a user starts on a CUDA box) with
# model.path a folder written by transformers' save_pretrained. Every run's log and metrics.jsonl come back in
# $OUT/runs-PART.tgz; `python benchmarks/sft_train_runs.py` turns them into docs/benchmarks/sft_train_gpu.md.
set -uo pipefail
export PYTHONPATH=/tmp/site:$(ls -d "$PWD"/packages/*/src | paste -sd:)
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
WORK=${WORK:-/tmp/gpu_train}
RUNS=$WORK/runs
mkdir -p "$OUT" "$RUNS" "$WORK/ckpt" "$WORK/data"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$RUNS/device.txt"
python3 -c "import torch, triton, fla, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__, 'transformers', transformers.__version__)" | tee -a "$RUNS/device.txt"

checkpoint() {  # checkpoint SHAPE: a folder written by transformers (random init), once per machine
  [ -f "$WORK/ckpt/$1/config.json" ] || timeout 300 python3 benchmarks/gpu_train_assets.py checkpoint --shape "$1" \
    --out "$WORK/ckpt/$1" 2>&1 | tail -2
}
long_docs() {  # long_docs SEQ_LEN: one-document rows of exactly SEQ_LEN tokens
  [ -f "$WORK/data/long-$1.jsonl" ] || python3 benchmarks/gpu_train_assets.py long-docs --seq-len "$1" --rows 4 \
    --out "$WORK/data/long-$1.jsonl"
}
# train NAME LIMIT_S SHAPE SEQ_LEN STEPS [overrides...]: one sft-train run, its log and metrics kept under $RUNS/NAME
train() {
  local name=$1 limit=$2 shape=$3 seq=$4 steps=$5
  shift 5
  mkdir -p "$RUNS/$name"
  echo "== $name: $shape, S=$seq, $steps steps, $*" | tee "$RUNS/$name/log.txt"
  local started=$(date +%s)
  timeout "$limit" python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m sft_trainer.run \
    --model.path "$WORK/ckpt/$shape" --data.tokenizer "$WORK/ckpt/$shape" --data.path "$WORK/data/long-$seq.jsonl" \
    --data.seq_len "$seq" --model.dtype bfloat16 --parallel.backend nccl --parallel.cp 1 --train.steps "$steps" \
    --train.grad_accum 1 --train.lr 2e-5 --train.warmup_steps 2 --checkpoint.every 0 --checkpoint.export_hf false \
    --output_dir "$WORK/out/$name" --logging.metrics_file "$RUNS/$name/metrics.jsonl" "$@" \
    >> "$RUNS/$name/log.txt" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $(( $(date +%s) - started )) s" | tee -a "$RUNS/$name/log.txt"
  grep -E "^step|sft-train\]|Error|error" "$RUNS/$name/log.txt" | tail -6
  finish  # after every run: a call cut short at its limit still brings back what finished
}
finish() {
  tar czf "$OUT/runs-$PART.tgz" -C "$WORK" runs
}
PART=${1:-8k}
trap finish EXIT
case "$PART" in
  8k)
    checkpoint qwen3_5-0.8b
    long_docs 8192
    train r08_8k 420 qwen3_5-0.8b 8192 10 --parallel.fsdp false
    train r08_8k_fsdp 150 qwen3_5-0.8b 8192 10 --parallel.fsdp true --checkpoint.every 5 --checkpoint.export_hf true
    train r08_8k_fsdp_resume 120 qwen3_5-0.8b 8192 10 --parallel.fsdp true \
      --checkpoint.resume "$WORK/out/r08_8k_fsdp/checkpoints/step-000005"
    timeout 120 python3 benchmarks/export_logits.py --export "$WORK/out/r08_8k_fsdp/hf" --out "$RUNS/export" 2>&1 | tail -4
    rm -rf "$WORK/out"
    train r08_8k_ac 100 qwen3_5-0.8b 8192 10 --parallel.fsdp false --model.activation_checkpointing true
    mkdir -p "$RUNS/step_ac"
    timeout 150 python3 benchmarks/model_step.py --out "$RUNS/step_ac" --shapes qwen3_5-0.8b --seq-lens 8192 --reps 5 \
      --limit-s 60 --variants cp_models "cp_models + act. ckpt" 2>&1 | grep -E "^\||built"
    ;;
  32k)
    checkpoint qwen3_5-0.8b
    long_docs 32768
    train r08_32k_ac 200 qwen3_5-0.8b 32768 6 --parallel.fsdp false --model.activation_checkpointing true
    train r08_32k_ac_fsdp 90 qwen3_5-0.8b 32768 6 --parallel.fsdp true --model.activation_checkpointing true
    train r08_32k_lora 90 qwen3_5-0.8b 32768 6 --parallel.fsdp true --model.activation_checkpointing true \
      --train.lora.enabled true --train.lr 1e-4
    rm -rf "$WORK/out"
    mkdir -p "$RUNS/step32"
    timeout 100 python3 benchmarks/model_step.py --out "$RUNS/step32" --shapes qwen3_5-0.8b --seq-lens 32768 \
      --reps 3 --limit-s 60 --variants "cp_models + act. ckpt" 2>&1 | grep -E "^\||built"
    checkpoint qwen3_5-2b
    train r2b_32k_ac_fsdp 150 qwen3_5-2b 32768 6 --parallel.fsdp true --model.activation_checkpointing true
    rm -rf "$WORK/out"
    ;;
  final)  # cold machine, one call of at most $BUDGET_S seconds: the logits check overlaps the first run's compilation
    deadline=$(( $(date +%s) + ${BUDGET_S:-540} ))
    left() { local s=$(( deadline - $(date +%s) )); [ "$s" -lt "$1" ] && echo "$s" || echo "$1"; }
    checkpoint qwen3_5-0.8b
    long_docs 8192
    timeout 240 python3 benchmarks/export_logits.py --export "$WORK/ckpt/qwen3_5-0.8b" \
      --out "$RUNS/logits_qwen3_5-0.8b" > "$RUNS/logits_qwen.log" 2>&1 &
    train r08_8k_cold "$(left 300)" qwen3_5-0.8b 8192 10 --parallel.fsdp false
    wait
    grep -vE "Writing|Warning|warn" "$RUNS/logits_qwen.log" | tail -4
    rm -rf "$WORK/out"
    checkpoint nemotron_h-nano-8l
    long_docs 32768
    train nano8l_32k_ac "$(left 300)" nemotron_h-nano-8l 32768 6 --parallel.fsdp false \
      --model.activation_checkpointing true
    ;;
  cold)  # empty Triton cache: the 0.8B 8k run's first step with the fla configs shipped for this GPU
    checkpoint qwen3_5-0.8b
    long_docs 8192
    export TRITON_CACHE_DIR=/tmp/triton_cold_train
    rm -rf "$TRITON_CACHE_DIR"
    train r08_8k_cold_tuned 300 qwen3_5-0.8b 8192 10 --parallel.fsdp false
    rm -rf "$WORK/out"
    ;;
  compare)  # warm machine, nothing else running: the trainer's 8k step against the model step, same call
    checkpoint qwen3_5-0.8b
    long_docs 8192
    train r08_8k 150 qwen3_5-0.8b 8192 20 --parallel.fsdp false
    rm -rf "$WORK/out"
    mkdir -p "$RUNS/step"
    timeout 120 python3 benchmarks/model_step.py --out "$RUNS/step" --shapes qwen3_5-0.8b --seq-lens 8192 \
      --reps 10 --limit-s 60 --variants cp_models 2>&1 | grep -E "^\||built"
    ;;
  more)
    checkpoint nemotron_h-nano-8l
    long_docs 32768
    train nano8l_32k_ac_fsdp 300 nemotron_h-nano-8l 32768 6 --parallel.fsdp true --model.activation_checkpointing true
    rm -rf "$WORK/out"
    mkdir -p "$RUNS/vl"
    echo "== vl: tiny VL preset, bf16, nccl" | tee "$RUNS/vl/log.txt"
    timeout 120 python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m sft_trainer.run \
      --config tiny_vl_cpu --parallel.backend nccl --parallel.cp 1 --model.dtype bfloat16 \
      --output_dir "$WORK/out/vl" --logging.metrics_file "$RUNS/vl/metrics.jsonl" >> "$RUNS/vl/log.txt" 2>&1
    echo "== vl: exit $?" | tee -a "$RUNS/vl/log.txt"
    tail -4 "$RUNS/vl/log.txt"
    train r08_32k 150 qwen3_5-0.8b 32768 6 --parallel.fsdp false
    rm -rf "$WORK/out"
    ;;
esac
