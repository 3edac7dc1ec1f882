"""Tiny Qwen3.5-VL configs, packed rows with images, and weight randomization shared by the cp-vlm tests.

Module level so that gloo workers (spawned, importing by name) rebuild the same things from plain arguments.
"""

from __future__ import annotations

import random

import torch
from transformers import Qwen3_5Config, Qwen3_5MoeConfig

IMG, VIDEO, VSTART, VEND = 90, 91, 88, 89
VOCAB = 96
PATCH, TEMPORAL, MERGE = 4, 2, 2
PIXEL_DIM = 3 * TEMPORAL * PATCH * PATCH

TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    num_hidden_layers=3,
    # Real MRoPE on the 4 rotary dims of each head: the three axes take interleaved frequency slots.
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [2, 1, 1],
    },
)
MOE = dict(moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2)
VISION = dict(
    depth=2,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    out_hidden_size=32,
    patch_size=PATCH,
    temporal_patch_size=TEMPORAL,
    spatial_merge_size=MERGE,
    num_position_embeddings=16,
)


def make_config(moe: bool = False, tie: bool = False, **text_overrides):
    cls = Qwen3_5MoeConfig if moe else Qwen3_5Config
    return cls(
        text_config={**TEXT, **(MOE if moe else {}), **text_overrides},
        vision_config=dict(VISION),
        image_token_id=IMG,
        video_token_id=VIDEO,
        vision_start_token_id=VSTART,
        vision_end_token_id=VEND,
        tie_word_embeddings=tie,
    )


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights large enough that every path carries signal: matrices N(0, 0.2), vectors around their identity,
    GDN decays moderate. Works on our model and on transformers' (same parameter names)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            p.copy_(torch.rand(p.shape, generator=gen) * 2 - 2.5)
        elif name.endswith("linear_attn.norm.weight") or ("visual" in name and "norm" in name and leaf == "weight"):
            p.copy_(1 + 0.1 * noise)  # plain-weight norms: around 1
        elif p.dim() == 1:
            p.copy_(0.1 * noise)
        else:
            p.copy_(0.2 * noise)
    return model


# A document: a list of segments, ints (text lengths) or (t, h, w) patch grids (one image each).
Doc = list


def build_row(docs: list[Doc], seed: int = 0) -> dict:
    """input_ids [S], seq_lens, image_grid_thw [N, 3] or None, pixel_values [patches, PIXEL_DIM] or None, and the
    per-document pieces (ids, grids, pixel rows) for running documents alone."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    ids, grids, pixels, per_doc = [], [], [], []
    for doc in docs:
        d_ids, d_grids, d_pixels = [], [], []
        for seg in doc:
            if isinstance(seg, int):
                d_ids += [rng.randrange(0, 80) for _ in range(seg)]
            else:
                t, h, w = seg
                d_ids += [VSTART] + [IMG] * (t * h * w // MERGE**2) + [VEND]
                d_grids.append(list(seg))
                d_pixels.append(torch.randn(t * h * w, PIXEL_DIM, generator=gen))
        per_doc.append((torch.tensor(d_ids), d_grids, d_pixels))
        ids += d_ids
        grids += d_grids
        pixels += d_pixels
    return {
        "input_ids": torch.tensor(ids),
        "seq_lens": [len(d[0]) for d in per_doc],
        "image_grid_thw": torch.tensor(grids) if grids else None,
        "pixel_values": torch.cat(pixels) if pixels else None,
        "docs": per_doc,
    }


def pad_row(row: dict, multiple: int) -> dict:
    """Append a padding document so the row length divides by ``multiple``."""
    extra = (-row["input_ids"].numel()) % multiple
    if extra:
        row = dict(row)
        row["input_ids"] = torch.cat([row["input_ids"], torch.zeros(extra, dtype=torch.long)])
        row["seq_lens"] = [*row["seq_lens"], extra]
        row["docs"] = [*row["docs"], (torch.zeros(extra, dtype=torch.long), [], [])]
    return row
