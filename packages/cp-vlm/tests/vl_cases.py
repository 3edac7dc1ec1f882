"""Tiny Qwen3.5-VL configs, packed rows with images, and weight randomization shared by the cp-vlm tests.

Module level so that gloo workers (other processes, importing by name) rebuild the same things from plain arguments.
"""

from __future__ import annotations

import random

import torch

from cp_models.presets import tiny_qwen35_vl_config

IMG, VIDEO, VSTART, VEND = 90, 91, 88, 89
VOCAB = 96
PATCH, TEMPORAL, MERGE = 4, 2, 2
PIXEL_DIM = 3 * TEMPORAL * PATCH * PATCH

# Overrides of the tiny Qwen3.5-VL preset (cp_models.presets): a narrower 3-layer text model with real MRoPE on the
# 4 rotary dims of each head (the three axes take interleaved frequency slots), and a smaller vision tower.
TEXT = dict(
    hidden_size=32,
    intermediate_size=48,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    num_hidden_layers=3,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [2, 1, 1],
    },
    tie_word_embeddings=False,  # the VL model ties by the top-level flag
)
VISION = dict(
    hidden_size=16,
    intermediate_size=32,
    patch_size=PATCH,
    temporal_patch_size=TEMPORAL,
    spatial_merge_size=MERGE,
    num_position_embeddings=16,
)


def make_config(moe: bool = False, tie: bool = False, **text_overrides):
    """The MoE text model: the preset's 4 experts, top-2, expert 16 and shared expert 24 wide."""
    return tiny_qwen35_vl_config(
        VOCAB,
        moe=moe,
        text={**TEXT, **text_overrides},
        vision=VISION,
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
