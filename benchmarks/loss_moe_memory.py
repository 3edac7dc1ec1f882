"""Two parts of the planner's memory model measured alone on one GPU: the tiled loss's workspace and the MoE's
saved activations (pure torch: no fla needed).

    python benchmarks/loss_moe_memory.py --out DIR          # CUDA
    python benchmarks/loss_moe_memory.py --tokens 8192 --tile-kernels torch triton --out DIR   # the loss's tile passes
    uv run python benchmarks/loss_moe_memory.py --device cpu --tokens 512 --out /tmp/x   # CPU smoke run (no peaks)

loss: ``cp_models.loss.token_log_probs`` forward + backward on [T, hidden] bf16 states and the bf16 LM head of a
shape (the fastest of two steps after a first); peak = max allocated during the step minus what was allocated
before it (states, weight, its gradient), against ``sft_trainer.plan``'s loss workspace (``LOSS_COEFFICIENTS``).
moe: one MoE block on the grouped-GEMM path (what the model runs on CUDA bf16); allocated after forward minus before
(the activations kept for backward plus the block's output), against the planner's per-token "saved" bytes for
the block plus its output.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_step import load_shape

GIB = 2**30


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _allocated(device: str) -> int:
    return torch.cuda.memory_allocated() if device.startswith("cuda") else 0


def loss_row(
    shape: str,
    tokens: int,
    device: str,
    tile: tuple[int | None, int | None] = (None, None),
    tile_kernels: str = "torch",
) -> dict:
    from cp_models.loss import loss_tile_shape, token_log_probs
    from sft_trainer.plan import loss_workspace_bytes

    config = load_shape(shape)
    tile = loss_tile_shape(tokens, config.vocab_size, *tile)
    weight = torch.randn(config.vocab_size, config.hidden_size, device=device, dtype=torch.bfloat16) * 0.02
    weight.requires_grad_(True)
    hidden = torch.randn(tokens, config.hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, config.vocab_size, (tokens,), device=device)
    times = []
    for _ in range(3):  # the later steps are measured (the weight's gradient exists, as in training)
        hidden.grad = None
        _sync(device)
        base = _allocated(device)
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        (-token_log_probs(hidden, weight, labels, *tile, tile_kernels=tile_kernels).mean()).backward()
        _sync(device)
        times.append((time.perf_counter() - start) * 1000)
    peak = torch.cuda.max_memory_allocated() - base if device.startswith("cuda") else None
    planned = loss_workspace_bytes(config.vocab_size, config.hidden_size, tokens, 2, tile)
    kernels = "" if tile_kernels == "torch" else f", {tile_kernels} tile kernels"
    return dict(part=f"loss (tile {tile[0]} x {tile[1]}{kernels})", shape=shape, tokens=tokens, ms=min(times[1:]),
                measured_gib=peak and peak / GIB, planned_gib=planned / GIB, tile=list(tile))  # fmt: skip


def moe_row(shape: str, tokens: int, device: str) -> dict:
    from cp_models.nemotron_h import NemotronHMoE
    from cp_models.qwen3_5 import Qwen35SparseMoeBlock
    from sft_trainer.plan import activation_bytes_per_token

    config = load_shape(shape)
    torch.manual_seed(0)
    block = (NemotronHMoE if config.model_type == "nemotron_h" else Qwen35SparseMoeBlock)(config)
    block = block.to(device=device, dtype=torch.bfloat16)
    for module in block.modules():
        if hasattr(module, "_grouped"):  # forward picks it on CUDA bf16; forced so the CPU smoke run takes it too
            module.forward = module._grouped
    x = torch.randn(tokens, config.hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)
    _sync(device)
    base = _allocated(device)
    start = time.perf_counter()
    out = block(x)
    _sync(device)
    kept = _allocated(device) - base
    out.float().square().mean().backward()
    _sync(device)
    ms = (time.perf_counter() - start) * 1000
    planned = tokens * (activation_bytes_per_token(config, 1)["moe"]["saved"] + config.hidden_size * 2)
    return dict(part="moe (saved + output)", shape=shape, tokens=tokens, ms=ms,
                measured_gib=kept / GIB if device.startswith("cuda") else None, planned_gib=planned / GIB)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--loss-tile", type=int, nargs=2, default=(None, None), metavar=("TOKENS", "VOCAB"),
                        help="the loss's tile (default: what the models run, cp_models.loss.LOSS_TILE)")  # fmt: skip
    parser.add_argument("--tile-kernels", nargs="+", choices=("torch", "triton"), default=["torch"],
                        help="the loss's per-tile passes (cp_models.loss_tiles): a loss row per choice")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = parser.parse_args()
    rows = []
    jobs = [(loss_row, s, k) for s in ("qwen3_5-0.8b", "qwen3_5-2b", "nemotron_h-nano-8l") for k in args.tile_kernels]
    jobs += [(moe_row, s, None) for s in ("qwen3_5-35b-a3b-8l", "nemotron_h-nano-8l")]
    for fn, shape, kernels in jobs:
        extra = (tuple(args.loss_tile), kernels) if fn is loss_row else ()
        rows.append(fn(shape, args.tokens, args.device, *extra))
        print(json.dumps(rows[-1]), flush=True)
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(write_table(rows, device_name, args.tokens, args.out, shlex.join(sys.argv[1:])))


def write_table(rows: list[dict], device_name: str, tokens: int, out: Path, argv: str, notes: str = "") -> str:
    lines = [
        f"# Planner parts measured alone on one {device_name} (bf16, {tokens} tokens)",
        "",
        f"Method in benchmarks/loss_moe_memory.py. Reproduce: `python benchmarks/loss_moe_memory.py{' ' + argv if argv else ''}`",
        "",
        "| part | shape | ms (fwd + bwd) | measured GiB | planner GiB | planner / measured |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        measured = "-" if r["measured_gib"] is None else f"{r['measured_gib']:.2f}"
        ratio = "-" if r["measured_gib"] is None else f"{r['planned_gib'] / r['measured_gib']:.3f}"
        lines.append(f"| {r['part']} | {r['shape']} | {r['ms']:.1f} | {measured} | {r['planned_gib']:.2f} | {ratio} |")
    text = "\n".join(lines) + "\n" + (f"\n{notes}\n" if notes else "")
    out.mkdir(parents=True, exist_ok=True)
    (out / "loss_moe_memory.md").write_text(text)
    (out / "loss_moe_memory.json").write_text(json.dumps({"device": device_name, "rows": rows}, indent=1))
    return text


if __name__ == "__main__":
    main()
