"""Qwen3.5-0.8B-shaped model: forward + backward tokens/s and peak memory, ours vs transformers, on one GPU.

    python benchmarks/qwen35_step.py [--seq-lens 8192 32768] [--variants ...] [--out DIR]

Random weights, bf16, one packed row of one document, loss = mean token cross-entropy. Ours: cp_models
Qwen35ForCausalLM (fla kernels for GDN and conv, torch varlen attention, chunked loss that never builds [S, vocab]
logits), with and without activation checkpointing, and with torch.compile of each block's collective-free parts
(sft_trainer.parallelize.apply_compile). transformers: Qwen3_5ForCausalLM (SDPA, fla installed, loss
from ``labels``), with and without gradient checkpointing, in the same process. Median of 3 timed steps after 2
warm-ups; peak = torch.cuda.max_memory_allocated during those steps. Writes qwen35_step.md (and .json) to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

CONFIG = dict(  # Qwen3.5-0.8B text shape (public config)
    vocab_size=248320,
    hidden_size=1024,
    intermediate_size=3584,
    num_hidden_layers=24,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    tie_word_embeddings=True,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
    },
)


VARIANTS = {
    "cp_models": "eager",
    "cp_models + compile": "torch.compile of norms and MLPs",
    "cp_models + act. ckpt": "activation checkpointing of every block",
    "cp_models + act. ckpt + compile": "both",
    "transformers": "SDPA, fla",
    "transformers + grad. ckpt": "gradient checkpointing",
}


def _step_ours(model, ids, labels, seq_len):
    out = model(ids, [seq_len], labels=labels)
    loss = -out.token_log_probs.sum() / (labels >= 0).sum()
    loss.backward()
    return loss


def _step_hf(model, ids, labels, seq_len):
    loss = model(input_ids=ids[None], labels=labels[None]).loss
    loss.backward()
    return loss


def measure(name, model, step, seq_len, reps=3):
    torch.manual_seed(0)
    ids = torch.randint(0, CONFIG["vocab_size"], (seq_len,), device="cuda")
    labels = ids.clone()
    times = []
    try:
        for i in range(reps + 2):
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if i == 2:
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            loss = step(model, ids, labels, seq_len)
            torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - start)
        ms = sorted(times)[len(times) // 2] * 1000
        peak = torch.cuda.max_memory_allocated() / 2**30
        row = {
            "model": name,
            "seq_len": seq_len,
            "ms": ms,
            "tokens_per_s": seq_len / ms * 1000,
            "peak_gib": peak,
            "loss": float(loss),
        }
    except torch.cuda.OutOfMemoryError:
        row = {"model": name, "seq_len": seq_len, "ms": None, "tokens_per_s": None, "peak_gib": None, "loss": None}
    model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.empty_cache()
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = parser.parse_args()
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from cp_models import Qwen35ForCausalLM, apply_activation_checkpointing
    from sft_trainer.parallelize import apply_compile

    config = Qwen3_5TextConfig(**CONFIG)
    rows = []
    for variant in args.variants:
        torch.manual_seed(0)
        started = time.perf_counter()
        if variant.startswith("transformers"):
            config._attn_implementation = "sdpa"
            with torch.device("cuda"):  # initialize on the GPU: building 752M parameters on the host takes long
                model, step = Qwen3_5ForCausalLM(config).to(torch.bfloat16), _step_hf
            if variant != "transformers":
                model.gradient_checkpointing_enable()
        else:
            with torch.device("cuda"):
                model, step = Qwen35ForCausalLM(config).to(torch.bfloat16), _step_ours
            if "ckpt" in variant:
                apply_activation_checkpointing(model)
            if "compile" in variant:
                apply_compile(model)
        params = sum(p.numel() for p in model.parameters())
        print(f"{variant}: built in {time.perf_counter() - started:.1f} s", flush=True)
        for seq_len in args.seq_lens:
            rows.append(measure(variant, model, step, seq_len))
        del model
        gc.collect()
        torch.cuda.empty_cache()

    device = torch.cuda.get_device_name()
    lines = [
        f"# Qwen3.5-0.8B shape: forward + backward on one {device} (bf16, {params / 1e6:.0f}M parameters)",
        "",
        "One document per row, random weights, mean token cross-entropy; median of 3 steps after 2 warm-ups.",
        "transformers with fla installed (its GDN kernels) and SDPA attention, in the same process as ours.",
        "Reproduce on the GPU machine: `bash benchmarks/gpu_session_models.sh qwen35` after staging fla (see the script).",
        "",
        "| model | S | ms / step | tokens/s | peak GiB |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if r["ms"] is None:
            lines.append(f"| {r['model']} | {r['seq_len']} | OOM | - | > 139 |")
        else:
            lines.append(
                f"| {r['model']} | {r['seq_len']} | {r['ms']:.0f} | {r['tokens_per_s']:.0f} | {r['peak_gib']:.1f} |"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "qwen35_step.md").write_text("\n".join(lines) + "\n")
    (args.out / "qwen35_step.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
