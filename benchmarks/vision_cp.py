"""Qwen3.5-VL vision tower under CP: one rank's encode time and peak memory, vision_cp "shard" vs "replicate".

    python benchmarks/vision_cp.py --out DIR                  # one CUDA GPU; writes DIR/vision_cp.{md,json}
    uv run python benchmarks/vision_cp.py --device cpu --tiny  # CPU smoke run of the code path

transformers' Qwen3.5 vision tower at its default (large) config: 27 blocks, width 1152, 16 heads, patch 16,
temporal patch 2, spatial merge 2 (about 0.4B parameters), output width 2048, bf16. Each image is 448 x 448
(a 28 x 28 patch grid: 784 patches, 196 merged tokens). A row holds 8 or 32 images. One rank's share of the row's
vision work runs through the model's own code (``Qwen35VLForConditionalGeneration.encode_images``) as rank 0 of
a ``fake`` process group of ``cp`` ranks (true shapes, free collectives): under "replicate" every rank encodes all
images; under "shard" rank 0 encodes its balanced share (``ceil(images / cp)`` here) and the all-gather of the
merged embeddings costs ``(cp - 1) * max_share_tokens * 2048 * 2`` bytes sent per rank, forward, and the same in
backward (reduce-scatter); its time is estimated at the stated NVLink bandwidth and added. Forward + backward
with a random output gradient; median of 3 after 1 warm-up; peak = max memory allocated above the weights.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

NVLINK_GBPS = 450.0
IMAGE_SIDE = 448


def build_model(tiny: bool, device: str):
    from transformers import Qwen3_5Config

    from cp_vlm import Qwen35VLForConditionalGeneration

    vision = {} if not tiny else dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2)
    hidden = 64 if tiny else 2048
    config = Qwen3_5Config(
        text_config=dict(
            vocab_size=256,
            hidden_size=hidden,
            intermediate_size=64,
            num_hidden_layers=1,
            layer_types=["full_attention"],
            num_attention_heads=8,  # only the vision tower runs; 8 heads let cp go to 8
            num_key_value_heads=8,
            head_dim=8,
        ),
        vision_config=dict(vision, out_hidden_size=hidden),
    )
    with torch.device(device):
        model = Qwen35VLForConditionalGeneration(config, vision_attention="sdpa")
    return model.to(torch.bfloat16)


def one_rank(model, num_images: int, cp: int, mode: str, device: str, reps: int) -> dict:
    from cp_core import CPTopology
    from cp_core.testing import fake_process_group
    from cp_models import set_context_parallel_attributes

    patch = model.config.vision_config.patch_size
    side = IMAGE_SIDE // patch
    grids = torch.tensor([[1, side, side]] * num_images)
    pixel_dim = 3 * model.config.vision_config.temporal_patch_size * patch * patch
    pixels = torch.randn(num_images * side * side, pixel_dim, device=device, dtype=torch.bfloat16)
    with fake_process_group(0, cp) as group:
        try:
            set_context_parallel_attributes(model, CPTopology.from_group(group))
            model.vision_cp = mode
            cuda = device.startswith("cuda")
            times = []
            base = torch.cuda.memory_allocated() if cuda else 0
            for i in range(reps + 1):
                model.zero_grad(set_to_none=True)
                if cuda:
                    torch.cuda.synchronize()
                    if i == 1:
                        torch.cuda.reset_peak_memory_stats()
                start = time.perf_counter()
                out = model.encode_images(pixels, grids)
                out.backward(torch.randn_like(out))
                if cuda:
                    torch.cuda.synchronize()
                if i >= 1:
                    times.append((time.perf_counter() - start) * 1000)
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else float("nan")
        finally:
            model.zero_grad(set_to_none=True)
    merged = side * side // model.config.vision_config.spatial_merge_size**2
    share = num_images if mode == "replicate" or cp == 1 else math.ceil(num_images / cp)
    sent = 0 if mode == "replicate" or cp == 1 else 2 * (cp - 1) * share * merged * model.lm_head.in_features * 2
    ms = sorted(times)[len(times) // 2]
    comm_ms = sent / NVLINK_GBPS / 1e6
    return dict(
        images=num_images, cp=cp, mode=mode, images_encoded=share, ms=ms, peak_gib=peak, mib_sent=sent / 2**20,
        comm_ms=comm_ms, total_ms=ms + comm_ms,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--images", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--cps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    model = build_model(args.tiny, args.device)
    params = sum(p.numel() for p in model.model.visual.parameters())
    rows = []
    for num_images in args.images:
        whole = one_rank(model, num_images, 1, "replicate", args.device, args.reps)
        rows.append(whole)
        print(whole, flush=True)
        for cp in args.cps:
            rows.append(dict(whole, cp=cp))  # a replicating rank does the cp = 1 work at every cp
            rows.append(one_rank(model, num_images, cp, "shard", args.device, args.reps))
            print(rows[-1], flush=True)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    lines = [
        f"# Qwen3.5-VL vision tower under CP: one rank's share on {device} (bf16, {params / 1e6:.0f}M parameters)",
        "",
        f"Images of {IMAGE_SIDE} x {IMAGE_SIDE}, forward + backward; est. comm = all-gather + reduce-scatter bytes / "
        f"{NVLINK_GBPS:.0f} GB/s. Reproduce: `python benchmarks/vision_cp.py`. A replicating rank does the cp = 1 "
        "work at every cp (measured once).",
        "",
        "| images | cp | vision_cp | images encoded | ms fwd+bwd | peak GiB | MiB sent | est. comm ms | est. total ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['images']} | {r['cp']} | {r['mode']} | {r['images_encoded']} | {r['ms']:.1f} | {r['peak_gib']:.2f} "
            f"| {r['mib_sent']:.1f} | {r['comm_ms']:.3f} | {r['total_ms']:.1f} |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vision_cp.md").write_text("\n".join(lines) + "\n")
    (args.out / "vision_cp.json").write_text(json.dumps({"device": device, "params": params, "rows": rows}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
