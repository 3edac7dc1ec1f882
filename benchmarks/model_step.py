"""Forward + backward of whole models on one GPU: ours vs transformers, same process, tokens/s, MFU, peak memory.

    python benchmarks/model_step.py --shapes qwen3_5-0.8b --seq-lens 8192 32768 [--variants ...] --out DIR
    uv run python benchmarks/model_step.py --tiny --device cpu --out /tmp/x     # CPU smoke run of every code path

Shapes are the shipped public configs (packages/sft-trainer/src/sft_trainer/configs/models), some at reduced depth
(the first layers of the real layer pattern): random weights, bf16, one packed row of one document, loss = mean
token cross-entropy. Ours: cp_models (fla GDN / SSD kernels, torch varlen attention, grouped-GEMM experts, chunked
loss that never builds [S, vocab] logits), with and without activation checkpointing, optionally torch.compile of
each block's collective-free parts. transformers: its ForCausalLM with its best kernels installed here (SDPA,
fla for GDN, grouped_mm experts; Nemotron-H's Mamba has no fast path without mamba-ssm), loss from ``labels``,
with and without gradient checkpointing. Median of --reps timed steps after 2 warm-ups; peak =
torch.cuda.max_memory_allocated over those steps.

MFU = model FLOPs per step / (ms x 989 TFLOP/s, the H200's dense bf16 peak), with model FLOPs =
6 x (matmul parameters a token meets: every linear incl. lm_head, routed experts x top_k / n_experts) x S
+ 6 x S^2 x H x D per softmax-attention layer (causal, QK^T and PV, forward 2 S^2 H D)
+ 6 x 2 x H x K x V x S per GDN layer and 6 x 2 x H x P x N x S per Mamba-2 layer (state read-out + update);
recomputation under checkpointing is not counted (model FLOPs, not hardware FLOPs).
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from sft_trainer.time_limit import time_limit

SHAPES_DIR = Path(__file__).resolve().parents[1] / "packages/sft-trainer/src/sft_trainer/configs/models"
H200_BF16_TFLOPS = 989.0

# name -> (shipped config, layers kept: None = all)
SHAPES = {
    "qwen3_5-0.8b": ("qwen3_5-0.8b", None),
    "qwen3_5-2b": ("qwen3_5-2b", None),
    "nemotron_h-nano-8l": ("nemotron_h-nano-30b-a3b", 8),
    "qwen3_5-35b-a3b-8l": ("qwen3_5-35b-a3b", 8),
}
TINY_WIDTHS = dict(  # --tiny: the same layer patterns at toy widths, for CPU runs of every code path
    qwen=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
              shared_expert_intermediate_size=32),
    nemotron=dict(vocab_size=512, hidden_size=64, intermediate_size=64, mamba_num_heads=8, mamba_head_dim=8,
                  n_groups=2, ssm_state_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  moe_shared_expert_intermediate_size=32),
)  # fmt: skip
VARIANTS = {
    "cp_models": "eager",
    "cp_models + torch loss tiles": "eager, the loss tiles' passes as torch ops instead of Triton kernels",
    "cp_models + graphed norms/MLP": "eager, each block's two norms and its MLP replayed as CUDA graphs "
    "(torch.cuda.make_graphed_callables, captured at the first row's length; Qwen3.5 dense, one length per run)",
    "cp_models + compiled norms/MLP (CUDA graphs)": "each block's two norms and its MLP under torch.compile's "
    "mode='reduce-overhead' (Inductor kernels replayed as CUDA graphs; Qwen3.5 dense)",
    "cp_models + act. ckpt": "activation checkpointing of every block",
    "cp_models + act. ckpt + compile": "checkpointing and torch.compile of norms and MLP/MoE",
    "cp_models + mamba-ssm": "eager, Mamba-2 conv and SSD on causal-conv1d and mamba-ssm (recurrent_backend mamba_ssm)",
    "transformers": "its best installed kernels",
    "transformers + grad. ckpt": "gradient checkpointing",
}


def load_shape(name: str, tiny: bool = False):
    """The transformers config of a benchmark shape (``--tiny``: same pattern, toy widths)."""
    from transformers import CONFIG_MAPPING

    file, layers = SHAPES[name]
    raw = json.loads((SHAPES_DIR / f"{file}.json").read_text())
    nemotron = raw["model_type"] == "nemotron_h"
    if layers is not None:
        raw["num_hidden_layers"] = layers
        if nemotron:
            raw["hybrid_override_pattern"] = raw["hybrid_override_pattern"][:layers]
    if tiny:
        widths = TINY_WIDTHS["nemotron" if nemotron else "qwen"]
        raw.update({k: v for k, v in widths.items() if k in raw})
        raw["num_hidden_layers"] = min(raw["num_hidden_layers"], 4 if not nemotron else 8)
        if nemotron:
            raw["hybrid_override_pattern"] = raw["hybrid_override_pattern"][: raw["num_hidden_layers"]]
    return CONFIG_MAPPING[raw["model_type"]].from_dict(raw)


def layer_kinds(config) -> list[str]:
    """'attention', 'gdn', 'mamba', 'mlp' or 'moe' per layer (the token mixer, or the FFN of Nemotron-H)."""
    if config.model_type == "nemotron_h":
        names = {
            "mamba": "mamba",
            "linear_attention": "mamba",
            "attention": "attention",
            "full_attention": "attention",
            "mlp": "mlp",
            "moe": "moe",
        }  # transformers 5.17 / newer names
        return [names[t] for t in config.layers_block_type]
    return ["attention" if t == "full_attention" else "gdn" for t in config.layer_types[: config.num_hidden_layers]]


def model_flops(model: torch.nn.Module, config, seq_len: int) -> float:
    """Model FLOPs of one forward + backward over one document of ``seq_len`` tokens (formula in the docstring)."""
    top_k = getattr(config, "num_experts_per_tok", 1)
    n_experts = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None) or 1
    matmul = 0.0
    for name, p in model.named_parameters():  # tied lm_head / embedding appear once: count it as the lm_head
        if p.dim() < 2 or "norm" in name or "conv" in name:
            continue
        if "embed" in name and not getattr(config, "tie_word_embeddings", False):
            continue  # an untied embedding is a lookup
        share = top_k / n_experts if ".experts." in name else 1.0  # routed experts (stacked: *.experts.<proj>)
        matmul += p.numel() * share
    flops = 6 * matmul * seq_len
    for kind in layer_kinds(config):
        if kind == "attention":
            flops += 6 * seq_len**2 * config.num_attention_heads * config.head_dim
        elif kind == "gdn":
            heads, k, v = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
            flops += 6 * 2 * heads * k * v * seq_len
        elif kind == "mamba":
            flops += 6 * 2 * config.mamba_num_heads * config.mamba_head_dim * config.ssm_state_size * seq_len
    return flops


def transformers_mamba_fast_path(model) -> bool:
    """Whether transformers' Nemotron-H Mamba mixer runs mamba-ssm's and causal-conv1d's kernels: releases that
    export ``is_fast_path_available`` say so; later ones take each package's kernel when the package imports."""
    module = sys.modules[type(model).__module__]
    if hasattr(module, "is_fast_path_available"):
        return bool(module.is_fast_path_available)
    try:
        import causal_conv1d  # noqa: F401
        import mamba_ssm.ops.triton.ssd_combined  # noqa: F401
    except Exception:
        return False
    return True


def build(variant: str, config, device: str):
    """The model of ``variant`` in bf16 on ``device``, and its step function (ids [S] -> loss, backward done)."""
    torch.manual_seed(0)
    nemotron = config.model_type == "nemotron_h"
    dtype = torch.bfloat16
    if variant.startswith("transformers"):
        import transformers

        cls = {"nemotron_h": "NemotronHForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
               "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}[config.model_type]  # fmt: skip
        config._attn_implementation = "sdpa"
        with torch.device(device):  # built on the GPU: billions of parameters take long on the host
            model = getattr(transformers, cls)(config).to(dtype)
        if "ckpt" in variant:
            model.gradient_checkpointing_enable()
        if nemotron:  # whether its Mamba mixer found mamba-ssm and causal-conv1d (else its slow torch path runs)
            print(f"transformers nemotron_h fast path: {transformers_mamba_fast_path(model)}")

        def step(ids):
            loss = model(input_ids=ids[None], labels=ids[None]).loss
            loss.backward()
            return loss

        return model, step

    from cp_models import NemotronHForCausalLM, Qwen35ForCausalLM, apply_activation_checkpointing
    from sft_trainer.parallelize import apply_compile

    kwargs = {"recurrent_backend": "mamba_ssm"} if "mamba-ssm" in variant else {}
    with torch.device(device):
        model = (NemotronHForCausalLM if nemotron else Qwen35ForCausalLM)(config, **kwargs).to(dtype)
    if "torch loss tiles" in variant:
        model.loss_tile_kernels = "torch"
    if "ckpt" in variant:
        apply_activation_checkpointing(model)
    if variant == "cp_models + compiled norms/MLP (CUDA graphs)":
        for layer in model.decoder_layers():
            for module in (layer.input_layernorm, layer.post_attention_layernorm, layer.mlp):
                module.compile(mode="reduce-overhead")
    elif "compile" in variant:
        apply_compile(model)

    graphed_at = []

    def step(ids, seq_lens=None):
        if "graphed" in variant and graphed_at != [ids.numel()]:
            if graphed_at:
                raise ValueError(f"{variant!r} is captured for {graphed_at[0]} tokens, not {ids.numel()}")
            graph_norms_and_mlps(model, ids.numel(), dtype)
            graphed_at.append(ids.numel())
        out = model(ids, [ids.numel()] if seq_lens is None else seq_lens, labels=ids)
        loss = -out.token_log_probs.sum() / ids.numel()
        loss.backward()
        return loss

    return model, step


def graph_norms_and_mlps(model, num_tokens: int, dtype: torch.dtype) -> None:
    """Replace each block's norms and MLP by CUDA-graphed versions for rows of ``num_tokens`` (the shapes these
    collective-free parts see do not depend on the documents in the row): how much of the 8k step's host time
    graphs can take away. Captured in forward order, so the graphs share one memory pool."""
    layers = list(model.decoder_layers())
    modules = [m for layer in layers for m in (layer.input_layernorm, layer.post_attention_layernorm, layer.mlp)]
    device = next(model.parameters()).device
    width = model.config.hidden_size
    samples = tuple((torch.randn(num_tokens, width, device=device, dtype=dtype, requires_grad=True),) for _ in modules)
    torch.cuda.make_graphed_callables(tuple(modules), samples, num_warmup_iters=3)  # patches each module's forward


class Timeout(Exception):
    pass


def timed_steps(
    step, ids, device: str, reps: int, warmup: int = 2, limit_s: float | None = None, first_limit_s: float | None = None
) -> dict:
    """Median ms of ``reps`` steps after ``warmup``, and peak GiB over the timed steps; 'OOM' / 'timeout'.

    ``limit_s`` bounds the steps after the first; the first (where fla compiles and autotunes, minutes on a fresh
    machine) has its own bound ``first_limit_s`` (default: ``limit_s``), and its wall time is ``first_step_s``."""
    cuda = device.startswith("cuda")
    times, first_s = [], None
    try:
        for i in range(warmup + reps):
            with time_limit((first_limit_s or limit_s) if i == 0 else limit_s, Timeout):
                if cuda:
                    torch.cuda.synchronize()
                    if i == warmup:
                        torch.cuda.reset_peak_memory_stats()
                start = time.perf_counter()
                loss = step(ids)
                if cuda:
                    torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            first_s = elapsed if i == 0 else first_s
            if i >= warmup:
                times.append(elapsed)
    except torch.cuda.OutOfMemoryError:
        return {"status": "OOM"}
    except Timeout:
        limit = (first_limit_s or limit_s) if first_s is None else limit_s
        return {"status": f"timeout ({limit:.0f} s)", "ms": times and sorted(times)[len(times) // 2] * 1000}
    ms = sorted(times)[len(times) // 2] * 1000
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return {"status": "ok", "ms": ms, "peak_gib": peak, "loss": float(loss), "first_step_s": first_s}


def free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def run_shape(
    shape: str,
    variants,
    seq_lens,
    device: str,
    reps: int,
    tiny: bool,
    limit_s: float | None,
    on_row=print,
    first_limit_s: float | None = None,
) -> list[dict]:
    config = load_shape(shape, tiny)
    rows = []
    for variant in variants:
        started = time.perf_counter()
        try:
            model, step = build(variant, config, device)
        except torch.cuda.OutOfMemoryError:
            rows += [dict(shape=shape, variant=variant, seq_len=s, status="OOM (weights)") for s in seq_lens]
            free(device)
            continue
        params = sum(p.numel() for p in model.parameters())
        print(f"{shape} / {variant}: {params / 1e6:.0f}M parameters, built in {time.perf_counter() - started:.1f} s")
        for seq_len in seq_lens:
            torch.manual_seed(0)
            ids = torch.randint(0, config.vocab_size, (seq_len,), device=device)
            row = dict(shape=shape, variant=variant, seq_len=seq_len, params=params)
            row.update(timed_steps(step, ids, device, reps, limit_s=limit_s, first_limit_s=first_limit_s))
            model.zero_grad(set_to_none=True)
            if row.get("ms"):
                row["tokens_per_s"] = seq_len / row["ms"] * 1000
                row["mfu"] = model_flops(model, config, seq_len) / (row["ms"] / 1000) / (H200_BF16_TFLOPS * 1e12)
            rows.append(row)
            on_row(row)
            free(device)
        del model, step
        free(device)
    return rows


def write_table(rows: list[dict], out: Path, device_name: str, reps: int, argv: list[str]) -> str:
    lines = [
        f"# Model step: forward + backward on one {device_name} (bf16, random weights)",
        "",
        "One document per row, mean token cross-entropy; median of "
        f"{reps} steps after 2 warm-ups; peak = max allocated. MFU: formula in benchmarks/model_step.py.",
        "ours vs transformers in the same process. Shapes at reduced depth keep the first layers of the real pattern.",
        "",
        f"Reproduce on the GPU machine (fla staged): `python benchmarks/model_step.py {shlex.join(argv)}`",
        "",
        "| shape | variant | S | ms / step | tokens/s | MFU | peak GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r['shape']} | {r['variant']} | {r['seq_len']} | {r['status']} | - | - | - |")
            continue
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        lines.append(
            f"| {r['shape']} | {r['variant']} | {r['seq_len']} | {r['ms']:.0f} | {r['tokens_per_s']:.0f} "
            f"| {100 * r['mfu']:.1f} % | {peak} |"
        )
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "model_step.md").write_text(text)
    (out / "model_step.json").write_text(json.dumps({"device": device_name, "rows": rows}, indent=1))
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--limit-s", type=float, default=120.0, help="give up on a step of a (variant, S) after this long"
    )
    parser.add_argument("--first-step-limit-s", type=float, default=400.0,
                        help="the same for the first step of a (variant, S), where fla compiles and autotunes")  # fmt: skip
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="toy widths (CPU check of the code paths)")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--write-fla-tuning", type=Path, metavar="DIR",
                        help="after the rows, write fla's autotune choices into DIR/<GPU name>/fla-<version> "
                        "(cp_core.fla_tuning; DIR may be a CP_FLA_TUNING_DIR or cp_core's shipped fla_tuning)")  # fmt: skip
    args = parser.parse_args()
    if args.device.startswith("cuda"):
        from cp_core.fla_tuning import use_fla_tuning

        print(f"fla tuning: {use_fla_tuning(torch.device(args.device)) or 'none (fla autotunes)'}", flush=True)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    rows = []

    def on_row(row):  # the table is rewritten after every row, so a run cut short keeps what it measured
        print(json.dumps(row), flush=True)
        rows.append(row)
        write_table(rows, args.out, device_name, args.reps, sys.argv[1:])

    for shape in args.shapes:
        run_shape(shape, args.variants, args.seq_lens, args.device, args.reps, args.tiny, args.limit_s, on_row,
                  first_limit_s=args.first_step_limit_s)  # fmt: skip
    print(write_table(rows, args.out, device_name, args.reps, sys.argv[1:]))
    if args.write_fla_tuning:
        from cp_core.fla_tuning import tuning_folder, write_fla_tuning

        folder = tuning_folder(args.write_fla_tuning, torch.device(args.device))
        print(f"fla tuning: {write_fla_tuning(folder)} choices written to {folder}")


if __name__ == "__main__":
    main()
