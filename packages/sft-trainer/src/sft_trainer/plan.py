"""``sft-train plan``: what a run will send and hold per rank, and the longest row that fits, before anything starts.

From the validated :class:`~sft_trainer.config.TrainConfig` and nothing bigger than the model's config, it reports

1. per layer type: how many there are, the CP strategy at this ``cp`` (attention: Ulysses or all-gathered KV,
   ``parallel.attention_cp``), and the bytes each rank sends per row (forward + backward, the busiest rank, one
   document spanning the row), with totals, the state-passing / all-to-all / all-gather shares and the time at a
   stated NVLink bandwidth;
2. the memory per rank (parameters, gradients, AdamW state, activations, backward workspace, headroom) with and
   without activation checkpointing;
3. the longest ``data.seq_len`` that fits the GPU at this ``cp`` and at every valid cp in 1, 2, 4, ..., 64;
4. the reason, with the numbers that fix it, when the run cannot work.

The byte counts are exact closed forms of what cp_core's collectives send (tests compare them with
``cp_core.testing.CommCounter``). The memory model is a per-layer-type count of the tensors the fast CUDA path
(fla kernels, varlen attention, grouped-GEMM MoE, the tiled loss) keeps for backward; every coefficient lives in
:data:`ACTIVATION_COEFFICIENTS` and the few tables below it, so they can be calibrated against measurements.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from cp_models.common import loss_tile_shape

# ----------------------------------------------------------------------------------------------------------
# Memory coefficients (calibrate these)
#
# ACTIVATION_COEFFICIENTS[part][phase] maps a *width* to how many tensors of that width per local token the part
# holds. Widths are element counts per local token computed from the config by `layer_widths` (e.g. "hidden" =
# hidden_size, "gdn_v" = value heads x value head dim). A width name alone is in the activation dtype
# (model.dtype); the suffix "_f32" means 4 bytes an element, "_i64" 8 bytes. Phases:
#   "saved":     kept from this part's forward until its backward (what activation checkpointing recomputes);
#   "transient": alive only while this part runs backward (gradients of its inputs, kernel workspaces).
# Attention after the Ulysses exchange holds [S, heads/cp, D], the same bytes as [T, heads, D], T = S/cp local
# tokens, so all widths are per local token. Counted from cp_models' code on the CUDA bf16 path; noted per entry.
ACTIVATION_COEFFICIENTS: dict[str, dict[str, dict[str, float]]] = {
    # Qwen3.5 decoder layer around its mixer and feed-forward: input_layernorm and post_attention_layernorm are
    # fla's fused RMSNorm, which keeps its input x and the per-row rstd. Transient: the residual-stream gradient
    # in and out of the layer.
    "qwen3_5.block": {"saved": {"hidden": 2, "rows_f32": 2}, "transient": {"hidden": 2}},
    # Gated DeltaNet (fla chunk_gated_delta_rule, fla causal_conv1d, fla gated RMSNorm):
    #   hidden 1: the normed input read by in_proj_qkv/z/b/a (one tensor); gdn_conv 1: in_proj_qkv's output, kept
    #   by the conv; gdn_k 2: the L2-normed q and k fla keeps; gdn_v 4: fla's contiguous copy of v, z (kept by the
    #   gated norm), the recurrence output (norm input), the norm output (out_proj input); gdn_vheads 1: beta =
    #   sigmoid(b); gdn_chunk_a 1: fla's WY matrix A [T, Hv, 64]; gdn_kheads_f32 2: q and k rstd;
    #   gdn_vheads_f32 4: softplus input and output of the decay, fla's chunk-cumsum of g, the norm's rstd.
    #   The conv output itself is not kept (fla copies the non-contiguous q, k, v splits).
    # Transient: fla's backward recomputes the chunk states h and computes dh ([T/64, Hv, K, V] each), plus the
    # gradients of the conv input and of v/z.
    "qwen3_5.gdn": {
        "saved": {
            "hidden": 1,
            "gdn_conv": 1,
            "gdn_k": 2,
            "gdn_v": 4,
            "gdn_vheads": 1,
            "gdn_chunk_a": 1,
            "gdn_kheads_f32": 2,
            "gdn_vheads_f32": 4,
        },
        "transient": {"gdn_chunk_state": 2, "gdn_conv": 1, "gdn_v": 2},
    },
    # GDN under CP (cp > 1), ranks whose last document continues: gated_delta_rule_cp's pre-pass over that
    # document's local stretch runs in activation-checkpointed segments of 16k tokens (PREPASS_SEGMENT_TOKENS). It
    # keeps its inputs and one [Hv, K, V (+ K)] state per segment. Its inputs are the normalized q, k and the
    # contiguous v the main kernel keeps anyway, and beta, also fla's; only g is its own (gdn_vheads_f32 1). Its
    # backward, one segment at a time, runs after the main pass's backward has freed that kernel's saved set and
    # chunk states, which a segment's (at most T tokens, v widened by K identity columns where the state passes
    # through) do not exceed by more than the width. tests/test_trainer_plan.py keeps the two earlier models for
    # the rows recorded with them: a second set of GDN activations (before the segments), then the whole conv
    # output q, k, v were views of (segments reading the raw views, 2026-12-04s).
    "qwen3_5.gdn_prepass": {"saved": {"gdn_vheads_f32": 1}, "transient": {}},
    # Gated softmax attention (torch varlen attention / flash, fla RMSNorm for q/k):
    #   hidden 1: normed input of q/k/v_proj; attn_q 5: q_proj's [query | gate] output (2, kept by q_norm, which
    #   reads a view of it), the attention output, sigmoid(gate), o_proj's input; attn_kv 1: k_proj's output
    #   (kept by k_norm); attn_gathered 1: q, k, v after the Ulysses exchange, (Hq + 2 max(Hkv, cp)) D (at cp 1 the
    #   rotated q, k and v); attn_q_cp 1: the output after the exchange back (cp > 1 only; at cp 1 it is the
    #   attention output itself); q_heads_f32 2: the softmax log-sum-exp and q_norm's rstd; kv_heads_f32 1: k_norm's.
    # Transient: dq/dk/dv in the gathered layout and their exchange buffers, the output gradient (attn_q 2; 3 before
    # 2026-12-04s, when no measured peak of 4 .. 16 ranks at 32k tokens a rank was the attention layer's: each
    # equalled the GDN-bound peak within 0.05 GiB, below the 3-unit estimate), fp32 dq accumulator.
    # All-gathered KV (attn_kv_row, 0 under Ulysses): the gathered row's k|v, saved 1; backward 0.3: the per-KV-head
    # key / value gradients over a rank's key range (one query head per kernel call, so flash-attn 2 never expands
    # them to [keys, Hq, D]), then the gather's one zeroed row buffer for the reduce-scatter once the saved row is
    # freed. Measured on the H200 (0.8B, 32k tokens a rank, middle rank): 1M / cp 32 and 2M / cp 64 peaked 2.2 and
    # 4.8 GiB above the 6.7 GiB of 128k / cp 4, for 2 and 4 GiB of row: 1.3 units; 512k / cp 16 (1 GiB) did not rise.
    # Ring-passed KV (cp_core.kv_ring; attn_kv_row 0): attn_gathered is the kernel's q (the swapped queries) and the
    # rank's own rotated k, v, (Hq + 2 Hkv) D, saved 1 with the fp32 log-sum-exp (q_heads_f32, as every path);
    # transient attn_kv_blocks 1, at most 16 Hkv D in the activation dtype: in backward the block in use and the one
    # arriving (2 x 2), the rank's fp32 share of the block's k / v gradients (4), the gradients received, the ones
    # still going out and the new ones (3 x 2). Modelled from the code, not yet measured on the GPU.
    "qwen3_5.attention": {
        "saved": {
            "hidden": 1,
            "attn_q": 5,
            "attn_kv": 1,
            "attn_gathered": 1,
            "attn_kv_row": 1,
            "attn_q_cp": 1,
            "q_heads_f32": 2,
            "kv_heads_f32": 1,
        },
        "transient": {"attn_gathered": 3, "attn_kv_row": 0.3, "attn_kv_blocks": 1, "attn_q": 2, "attn_q_f32": 1},
    },
    # SwiGLU MLP: its input (hidden 1); gate_proj and up_proj outputs (intermediate 2: silu(gate) and the product
    # are recomputed in backward, cp_models.common.swiglu_linear). Backward: silu(gate), then the product's
    # gradient, up's and gate's (at most 3 at once).
    "qwen3_5.mlp": {"saved": {"hidden": 1, "intermediate": 2}, "transient": {"intermediate": 3}},
    # Sparse MoE, grouped GEMM: hidden 2: the input (router, shared expert, its gate) and the shared expert's
    # output (kept by the gate multiply); experts_f32 1: the router softmax; topk_dim 2: tokens gathered per
    # expert slot and the expert outputs back in token order (kept by the weighted combine,
    # cp_models.common.combine_expert_outputs); topk_moe_inter 4: [gate | up] (2), silu(gate), the product;
    # topk_f32 2: top-k weights and their sum; topk_i64 2: gather/scatter indices; shared_inter 2: as the MLP;
    # rows 2: the shared-expert gate logit and sigmoid. Checked against the bytes autograd saves (tests/test_trainer_plan.py, CPU).
    "qwen3_5.moe": {
        "saved": {
            "hidden": 2,
            "experts_f32": 1,
            "topk_dim": 2,
            "topk_moe_inter": 4,
            "topk_f32": 2,
            "topk_i64": 2,
            "shared_inter": 2,
            "rows": 2,
        },
        "transient": {"topk_moe_inter": 2, "topk_dim": 1, "hidden": 1},
    },
    # Once per model: the final norm's input and output (the output is what the tiled loss keeps), its rstd, the
    # loss's log-sum-exp per token, and the rotary cos/sin [T, rotary_dim] every attention layer shares.
    "qwen3_5.model": {"saved": {"hidden": 2, "rows_f32": 2, "rotary": 2}, "transient": {}},
    # Nemotron-H block x + mixer(RMSNorm(x)): its RMSNorm is torch (fp32 inside), which keeps the fp32 copy of x
    # (for pow and the multiply) and the fp32 normalized x (for the weight multiply), and the rsqrt per row.
    "nemotron_h.block": {"saved": {"hidden_f32": 2, "rows_f32": 1}, "transient": {"hidden": 2}},
    # Mamba-2 mixer (fla causal_conv1d, fla chunk_simple_gla for SSD, fla gated RMSNorm):
    #   hidden 1: in_proj's input; mamba_in_proj 1: in_proj's [z | xBC | dt] output, kept whole by the gated norm
    #   reading the z view; mamba_conv_local 2: fla's contiguous copy of the conv input and the conv output (kept
    #   by the x views in x dt and D x) (a2a: this rank's heads over the whole row, with replicated groups);
    #   mamba_heads 1: dt in the activation dtype (x dt); mamba_heads_f32 4: softplus input and output, the
    #   clamped dt, fla's chunk-cumsum of dt A; mamba_hn 2: C and B expanded to heads (fla's q and k);
    #   mamba_hp 3: x dt (fla's v), the scan output (norm input), the norm output (out_proj input);
    #   mamba_groups_f32 1: the gated norm's rstd per group.
    # Transient: fla's backward keeps the chunk states h and dh in fp32 ([T/64, H, N, P] each), dq, dk, dv, and
    # the gradients of the conv input and of in_proj's output.
    "nemotron_h.mamba": {
        "saved": {
            "hidden": 1,
            "mamba_in_proj": 1,
            "mamba_conv_local": 2,
            "mamba_heads": 1,
            "mamba_heads_f32": 4,
            "mamba_hn": 2,
            "mamba_hp": 3,
            "mamba_groups_f32": 1,
        },
        "transient": {
            "mamba_chunk_state_f32": 2,
            "mamba_hn": 2,
            "mamba_hp": 2,
            "mamba_conv_local": 1,
            "mamba_in_proj": 1,
        },
    },
    # Mamba-2 state passing at cp > 1 (every rank): ssd_cp's exact first-document correction keeps C per group in
    # fp32 (the einsum's input), the einsum output in fp32 and the cumulative decay (for the shard's first
    # document: the whole shard when one document spans the row). Checked against autograd's saved bytes.
    "nemotron_h.mamba_correction": {
        "saved": {"mamba_gn_f32": 1, "mamba_hp_f32": 1, "mamba_heads_f32": 1},
        "transient": {},
    },
    # Attention without gate, norms or rotary: normed input; the gathered q, k, v; the attention output; the
    # output after the exchange back (cp > 1; o_proj's input); the log-sum-exp. All-gathered and ring-passed KV as
    # in Qwen3.5's.
    "nemotron_h.attention": {
        "saved": {"hidden": 1, "attn_gathered": 1, "attn_kv_row": 1, "attn_q": 1, "attn_q_cp": 1, "q_heads_f32": 1},
        "transient": {"attn_gathered": 3, "attn_kv_row": 0.3, "attn_kv_blocks": 1, "attn_q": 2, "attn_q_f32": 1},
    },
    # squared-ReLU MLP: input, up_proj's output (relu(x)^2 is recomputed in backward,
    # cp_models.common.squared_relu_linear). Backward: relu(x), the gradient, 2 relu(x) (at most 3 at once).
    "nemotron_h.mlp": {"saved": {"hidden": 1, "intermediate": 1}, "transient": {"intermediate": 3}},
    # MoE, grouped GEMM: hidden 1: the input (shared expert / latent projection); hidden_f32 1: its fp32 copy
    # (the fp32 router linear); experts_f32 1: sigmoid scores; topk_dim 2: tokens per expert slot and the expert
    # outputs back in token order (kept in bf16 by the fp32 weighted combine); topk_moe_inter 2: relu output and
    # its square; topk_f32 3: gathered, renormalized and re-ordered weights; topk_i64 2: indices; shared_inter 1:
    # as the MLP; latent 1: fc2_latent_proj's input (0 without). Checked against autograd's saved bytes (CPU).
    # Transient: the fp32 copy of the expert outputs inside the weighted combine, the inner gradients.
    "nemotron_h.moe": {
        "saved": {
            "hidden": 1,
            "hidden_f32": 1,
            "experts_f32": 1,
            "topk_dim": 2,
            "topk_moe_inter": 2,
            "topk_f32": 3,
            "topk_i64": 2,
            "shared_inter": 1,
            "latent": 1,
        },
        "transient": {"topk_dim_f32": 1, "topk_moe_inter": 2, "hidden": 1},
    },
    # Once per model: norm_f (torch, fp32 inside) keeps two fp32 copies and the rsqrt; its output is kept by the loss,
    # with the loss's log-sum-exp per token.
    "nemotron_h.model": {"saved": {"hidden_f32": 2, "hidden": 1, "rows_f32": 2}, "transient": {}},
}

# The tiled cross-entropy (cp_models.common.token_log_probs): tiles of [tokens, vocabulary] logits (LOSS_TILE,
# clipped to the shard and the vocabulary), the outer loop over the vocabulary while the shard has fewer tokens than
# the vocabulary, else over the tokens. At its backward's peak: one fp32 tile and its copy in the activation dtype,
# the full-size fp32 gradient accumulator (min(T, vocab) rows of hidden), the outer chunk's fp32 accumulator and one
# GEMM's fp32 output (max(tile rows, tile columns) rows of hidden), and the two gradients it returns ([T, hidden] and
# [vocab, hidden] in the activation dtype).
LOSS_COEFFICIENTS = {
    "tile_f32": 1.0,  # x tile tokens x tile vocabulary x 4 bytes
    "tile_act": 1.0,  # x tile tokens x tile vocabulary x activation bytes
    "accumulator_f32": 1.0,  # x min(T, vocab) x hidden x 4 bytes
    "chunk_rows_f32": 2.0,  # x max(tile tokens, tile vocabulary) x hidden x 4 bytes
    "gradients_act": 1.0,  # x (T + vocab) x hidden x activation bytes
}

# FSDP2 (sft_trainer.parallelize.apply_fsdp): the root unit (embeddings, final norm, LM head) stays gathered in
# the compute dtype from forward to backward; of the decoder blocks, the last stays gathered after forward, one is
# computing and one is prefetched. In backward a block's gradient exists unsharded in the compute dtype and in
# fp32 for the reduce-scatter, and the root's unsharded gradient lives until the end of backward.
FSDP_GATHERED_BLOCKS = 3
FSDP_GRADIENT_BLOCKS = 1

# Headroom on top of what the allocator hands out: CUDA context, NCCL buffers, allocator fragmentation.
HEADROOM = {"fixed_gib": 2.0, "fraction": 0.05}

# fla's chunk size (GDN's WY matrix and chunk states, SSD's chunk states).
FLA_CHUNK = 64

H200_GIB = 139.8  # torch.cuda.get_device_properties(0).total_memory of an H200, GiB
NVLINK_GBPS = 450.0  # H200 NVLink 4 stated per-direction bandwidth, GB/s (1e9 bytes)
PLANNED_CPS = (1, 2, 4, 8, 16, 32, 64)

__all__ = [
    "ACTIVATION_COEFFICIENTS",
    "FSDP_GATHERED_BLOCKS",
    "H200_GIB",
    "HEADROOM",
    "LOSS_COEFFICIENTS",
    "NVLINK_GBPS",
    "MemoryEstimate",
    "ParameterCount",
    "activation_bytes_per_token",
    "attention_strategy",
    "build_plan",
    "count_parameters",
    "estimate_memory",
    "format_plan",
    "gdn_bytes",
    "kv_gather_attention_bytes",
    "kv_ring_attention_bytes",
    "layer_widths",
    "longest_seq_len",
    "main",
    "mamba_bytes",
    "split_config_argument",
    "ulysses_attention_bytes",
    "valid_cp",
]

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ----------------------------------------------------------------------------------------------------------
# Bytes each rank sends (closed forms of cp_core's collectives)


def ulysses_attention_bytes(
    seq_len: int, cp: int, q_heads: int, kv_heads: int, head_dim: int, elem: int = 2, *, recompute: bool = False
) -> int:
    """Bytes one rank sends per Ulysses attention layer and row, forward + backward.

    ``2 (S/cp) (2 Hq + 2 max(Hkv, cp)) D elem (cp-1)/cp``: forward q, k, v (KV heads replicated up to cp) go to
    head layout in one all-to-all and the output comes back; backward the same in reverse. ``recompute``: activation
    checkpointing re-runs the forward (half of it) in backward.
    """
    if cp == 1:
        return 0
    total = 2 * (seq_len // cp) * (2 * q_heads + 2 * max(kv_heads, cp)) * head_dim * elem * (cp - 1) // cp
    return total + (total // 2 if recompute else 0)


def kv_gather_attention_bytes(
    seq_len: int,
    cp: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    elem: int = 2,
    *,
    recompute: bool = False,
    balance: bool = True,
    v_head_dim: int | None = None,
) -> int:
    """Bytes one rank sends per all-gather-KV attention layer and row, forward + backward, for one document spanning
    the row (the busiest case).

    ``2 (cp-1) (S/cp) 2 Hkv D elem``: forward the shard's k|v to every other rank (all-gather); backward the row's
    k|v gradients reduce-scattered, ``(cp-1)/cp`` of ``S 2 Hkv D``. ``balance`` (cp_core's default): rank pairs swap
    the second halves of their shards' queries and, back, their outputs; backward the output gradients and the
    query gradients: ``2 (S/cp - S/cp // 2) Hq (D + Dv) elem`` (``Dv``: ``v_head_dim``, default ``head_dim``;
    every rank but the middle one of an odd cp, which keeps its queries). ``k`` and ``v`` of different head dims
    are gathered apart, the same bytes when ``Dv = D``. ``recompute``: activation checkpointing re-runs the forward (half of it) in backward.
    """
    if cp == 1:
        return 0
    block, swap = _kv_block_and_swap_bytes(seq_len, cp, q_heads, kv_heads, head_dim, elem, balance, v_head_dim)
    total = 2 * (cp - 1) * block + swap
    return total + (total // 2 if recompute else 0)


def _kv_block_and_swap_bytes(seq_len, cp, q_heads, kv_heads, head_dim, elem, balance, v_head_dim) -> tuple[int, int]:
    """A rank's k|v bytes, and what balancing's query swap sends forward + backward (the busiest rank)."""
    local, dv = seq_len // cp, head_dim if v_head_dim is None else v_head_dim
    swap = 2 * (local - local // 2) * q_heads * (head_dim + dv) * elem if balance and local > 1 else 0
    return local * kv_heads * (head_dim + dv) * elem, swap


def kv_ring_attention_bytes(
    seq_len: int,
    cp: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    elem: int = 2,
    *,
    recompute: bool = False,
    balance: bool = True,
    v_head_dim: int | None = None,
) -> int:
    """Bytes one rank sends per ring-attention layer and row, forward + backward, for one document spanning the row
    (``cp - 1`` hops, every rank sending the same).

    With ``B = (S/cp) Hkv (D + Dv) elem``, a rank's k|v block: forward ``(cp-1) B`` (the block it holds, passed on
    each hop); backward ``2 (cp-1) B`` (the block and its gradient each hop) and ``B`` (the gradient back to its
    owner); plus the query swap of ``balance`` as in :func:`kv_gather_attention_bytes`. ``recompute``: activation
    checkpointing re-runs the forward share in backward.
    """
    if cp == 1:
        return 0
    block, swap = _kv_block_and_swap_bytes(seq_len, cp, q_heads, kv_heads, head_dim, elem, balance, v_head_dim)
    forward = (cp - 1) * block + swap // 2
    backward = 2 * (cp - 1) * block + block + swap // 2
    return forward + backward + (forward if recompute else 0)


def _state_passing_bytes(halo_channels: int, conv_width: int, state_elems: int, cp: int, elem: int, recompute: bool):
    """Conv halo (W-1 rows in the activation dtype) + one fp32 state, each way, for the busiest rank.

    Forward: a rank sends its last W-1 conv inputs and its outgoing state to the next rank; backward: the halo's
    and the state's gradients to the previous one. Interior ranks (cp > 2) do both, the chain ends only one (rank 0
    the forward sends, the last rank the backward ones)."""
    if cp == 1:
        return 0
    one_way = (conv_width - 1) * halo_channels * elem + 4 * state_elems
    if cp == 2:  # rank 0: forward only (sent again by recomputation); the last rank: backward only
        return one_way * (2 if recompute else 1)
    return one_way * (3 if recompute else 2)


def gdn_bytes(config, seq_len: int, cp: int, elem: int = 2, *, recompute: bool = False) -> int:
    """Bytes the busiest rank sends per Gated DeltaNet layer and row (forward + backward), one document spanning
    the row: ``causal_conv1d_cp``'s halo of ``W-1`` rows of q|k|v (``2 Hk K + Hv V`` channels, ``elem`` bytes) and
    ``gated_delta_rule_cp``'s fp32 state ``[Hv, K, V]``, to the next rank forward and back in backward (both on
    interior ranks, one at cp = 2). Independent of ``seq_len``."""
    k_heads, v_heads = config.linear_num_key_heads, config.linear_num_value_heads
    k_dim, v_dim = config.linear_key_head_dim, config.linear_value_head_dim
    channels = 2 * k_heads * k_dim + v_heads * v_dim
    return _state_passing_bytes(channels, config.linear_conv_kernel_dim, v_heads * k_dim * v_dim, cp, elem, recompute)


def mamba_bytes(config, style: str, seq_len: int, cp: int, elem: int = 2, *, recompute: bool = False) -> int:
    """Bytes the busiest rank sends per Mamba-2 layer and row (forward + backward), one document spanning the row.

    ``"state_passing"``: ``2 ((W-1)(HP + 2GN) elem + 4 HPN)`` (conv halo + fp32 SSD state, each way; half at cp 2);
    ``"a2a"``: ``2 T (2HP + 2G'N + H) elem (cp-1)/cp`` with ``T = S/cp``, ``G' = max(n_groups, cp)`` (x, B, C, dt to
    heads in one all-to-all, y back; the same backward)."""
    h, p, g, n, w = (
        config.mamba_num_heads,
        config.mamba_head_dim,
        config.n_groups,
        config.ssm_state_size,
        config.conv_kernel,
    )
    if cp == 1:
        return 0
    if style == "a2a":
        total = 2 * (seq_len // cp) * (2 * h * p + 2 * max(g, cp) * n + h) * elem * (cp - 1) // cp
        return total + (total // 2 if recompute else 0)
    if style != "state_passing":
        raise ValueError(f"unknown Mamba CP style {style!r}; choose 'state_passing' or 'a2a'")
    return _state_passing_bytes(h * p + 2 * g * n, w, h * p * n, cp, elem, recompute)


# ----------------------------------------------------------------------------------------------------------
# Model structure from the config


def _family(config) -> str:
    return "nemotron_h" if config.model_type == "nemotron_h" else "qwen3_5"


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_kinds(config) -> list[tuple[str, str | None]]:
    """Per decoder layer: (token mixer, feed-forward) kinds. Qwen3.5: ("gdn" | "attention", "mlp" | "moe");
    Nemotron-H: one of "mamba", "attention", "mlp", "moe" with feed-forward None (one mixer a block)."""
    if _family(config) == "nemotron_h":
        names = {"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp", "moe": "moe"}
        return [(names[t], None) for t in config.layers_block_type]
    ffn = "moe" if getattr(config, "num_experts", 0) else "mlp"
    mixers = {"linear_attention": "gdn", "full_attention": "attention"}
    return [(mixers[t], ffn) for t in config.layer_types[: config.num_hidden_layers]]


def _linears(config, kind: str) -> list[tuple[str, int, int, bool]]:
    """The nn.Linear modules of one layer part: (attribute name, in_features, out_features, has bias)."""
    h = config.hidden_size
    if _family(config) == "qwen3_5":
        if kind == "gdn":
            kd = config.linear_num_key_heads * config.linear_key_head_dim
            vd = config.linear_num_value_heads * config.linear_value_head_dim
            heads = config.linear_num_value_heads
            return [
                ("in_proj_qkv", h, 2 * kd + vd, False),
                ("in_proj_z", h, vd, False),
                ("in_proj_b", h, heads, False),
                ("in_proj_a", h, heads, False),
                ("out_proj", vd, h, False),
            ]
        if kind == "attention":
            d, bias = _head_dim(config), config.attention_bias
            q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
            return [
                ("q_proj", h, 2 * q, bias),
                ("k_proj", h, kv, bias),
                ("v_proj", h, kv, bias),
                ("o_proj", q, h, bias),
            ]
        if kind == "mlp":
            i = config.intermediate_size
            return [("gate_proj", h, i, False), ("up_proj", h, i, False), ("down_proj", i, h, False)]
        if kind == "moe":
            i = config.shared_expert_intermediate_size
            shared = [("gate_proj", h, i, False), ("up_proj", h, i, False), ("down_proj", i, h, False)]
            return [*shared, ("shared_expert_gate", h, 1, False)]
    else:
        if kind == "mamba":
            inner = config.mamba_num_heads * config.mamba_head_dim
            conv = inner + 2 * config.n_groups * config.ssm_state_size
            bias = config.use_bias
            return [("in_proj", h, inner + conv + config.mamba_num_heads, bias), ("out_proj", inner, h, bias)]
        if kind == "attention":
            d = _head_dim(config)
            q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
            return [
                ("q_proj", h, q, False),
                ("k_proj", h, kv, False),
                ("v_proj", h, kv, False),
                ("o_proj", q, h, False),
            ]
        bias = config.mlp_bias
        if kind == "mlp":
            i = config.intermediate_size
            return [("up_proj", h, i, bias), ("down_proj", i, h, bias)]
        if kind == "moe":
            i = config.moe_shared_expert_intermediate_size
            out = [("up_proj", h, i, bias), ("down_proj", i, h, bias)]
            latent = config.moe_latent_size
            if latent is not None:
                out += [("fc1_latent_proj", h, latent, bias), ("fc2_latent_proj", latent, h, bias)]
            return out
    raise ValueError(f"unknown layer kind {kind!r}")


def _other_parameters(config, kind: str) -> int:
    """Parameters of one layer part that are not nn.Linear weights (norms, convs, gates, stacked experts)."""
    h = config.hidden_size
    if _family(config) == "qwen3_5":
        if kind == "gdn":
            kd = config.linear_num_key_heads * config.linear_key_head_dim
            conv = 2 * kd + config.linear_num_value_heads * config.linear_value_head_dim
            heads = config.linear_num_value_heads
            return conv * config.linear_conv_kernel_dim + 2 * heads + config.linear_value_head_dim
        if kind == "attention":
            return 2 * _head_dim(config)
        if kind == "mlp":
            return 0
        if kind == "moe":
            e, i = config.num_experts, config.moe_intermediate_size
            return e * h + e * 3 * i * h
        if kind == "block":
            return 2 * h
    else:
        if kind == "mamba":
            heads, inner = config.mamba_num_heads, config.mamba_num_heads * config.mamba_head_dim
            conv = inner + 2 * config.n_groups * config.ssm_state_size
            return 3 * heads + conv * config.conv_kernel + (conv if config.use_conv_bias else 0) + inner
        if kind in ("attention", "mlp"):
            return 0
        if kind == "moe":
            e, i = config.n_routed_experts, config.moe_intermediate_size
            dim = config.moe_latent_size or h
            return e * h + 2 * e * i * dim
        if kind == "block":
            return h
    raise ValueError(f"unknown layer kind {kind!r}")


def _part_parameters(config, kind: str) -> int:
    linears = sum(i * o + (o if b else 0) for _, i, o, b in _linears(config, kind)) if kind != "block" else 0
    return linears + _other_parameters(config, kind)


def _lora_parameters(config, kind: str, targets: Sequence[str], rank: int) -> int:
    if kind == "block":
        return 0
    return sum(rank * (i + o) for name, i, o, _ in _linears(config, kind) if name in targets)


@dataclass(frozen=True)
class ParameterCount:
    """Parameters of a model from its config widths (equal to ``sum(p.numel())`` of the cp_models model)."""

    total: int
    embeddings: int
    """Input embeddings, LM head (when untied) and final norm: FSDP's root unit."""
    layers: dict[str, int]
    """Parameters per layer kind (all layers of that kind together; a Qwen3.5 layer's norms are in its mixer's)."""
    largest_block: int
    """The largest decoder block (what FSDP gathers at a time)."""
    lora: int = 0
    """LoRA adapter parameters (0 without LoRA)."""
    largest_block_lora: int = 0
    vision: int = 0
    """Vision tower parameters (VL models; in ``total``)."""

    @property
    def trainable(self) -> int:
        return self.lora if self.lora else self.total


def count_parameters(
    text_config, *, lora_targets: Sequence[str] | None = None, lora_rank: int = 8, vision: int = 0
) -> ParameterCount:
    """Parameter counts from the config widths; with ``lora_targets`` also the adapters' (``rank (in + out)`` per
    adapted linear layer). ``vision``: parameters of a VL model's vision tower, added to the total."""
    h, vocab = text_config.hidden_size, text_config.vocab_size
    tied = _family(text_config) == "qwen3_5" and text_config.tie_word_embeddings
    embeddings = vocab * h * (1 if tied else 2) + h
    layers: dict[str, int] = {}
    largest = largest_lora = lora = 0
    for mixer, ffn in layer_kinds(text_config):
        parts = [mixer, "block"] + ([ffn] if ffn else [])
        block = sum(_part_parameters(text_config, p) for p in parts)
        layers[mixer] = layers.get(mixer, 0) + block - (_part_parameters(text_config, ffn) if ffn else 0)
        if ffn:
            layers[ffn] = layers.get(ffn, 0) + _part_parameters(text_config, ffn)
        largest = max(largest, block)
        if lora_targets:
            block_lora = sum(_lora_parameters(text_config, p, lora_targets, lora_rank) for p in parts)
            lora += block_lora
            largest_lora = max(largest_lora, block_lora)
    total = embeddings + sum(layers.values()) + vision
    return ParameterCount(total, embeddings, layers, largest, lora, largest_lora, vision)


# ----------------------------------------------------------------------------------------------------------
# Activations


def _passes_state_through(cp: int, rank: int | None) -> bool:
    """Whether the recurrent state passes through this rank (one document spanning the row): a middle rank; the
    busiest rank (``rank`` None) is one whenever cp > 2."""
    return cp > 2 if rank is None else 0 < rank < cp - 1


def _runs_prepass(cp: int, rank: int | None) -> bool:
    """Whether this rank runs GDN's pre-pass (its last document continues on the next rank): all but the last."""
    return cp > 1 and (rank is None or rank < cp - 1)


def attention_strategy(text_config, cp: int, attention_cp: str = "ulysses") -> str | None:
    """How the model's softmax attention splits over ``cp`` under ``attention_cp``: "ulysses", "kv_gather" or
    "kv_ring" (cp_core.resolve_attention_cp_style; raises its error when forced Ulysses cannot); None without attention."""
    from cp_core import resolve_attention_cp_style

    types = text_config.layers_block_type if _family(text_config) == "nemotron_h" else text_config.layer_types
    if "full_attention" not in types:
        return None
    return resolve_attention_cp_style(
        attention_cp, text_config.num_attention_heads, text_config.num_key_value_heads, cp
    )


def layer_widths(
    text_config, cp: int, mamba_cp_style: str = "state_passing", rank: int | None = None, attention_cp: str = "ulysses"
) -> dict[str, float]:
    """Element counts per local token that :data:`ACTIVATION_COEFFICIENTS` multiplies (see its comment), for CP
    rank ``rank`` of one document spanning the row (None: the busiest rank)."""
    c = text_config
    w: dict[str, float] = {"hidden": c.hidden_size, "rows": 1}
    family = _family(c)
    w["intermediate"] = getattr(c, "intermediate_size", 0) or 0
    strategy = attention_strategy(c, cp, attention_cp)
    if strategy is not None:
        d, hq, hkv = _head_dim(c), c.num_attention_heads, c.num_key_value_heads
        gathered = strategy == "kv_gather" and cp > 1
        ring = strategy == "kv_ring" and cp > 1
        if gathered:
            kernel_inputs = hq * d
        elif ring:
            kernel_inputs = (hq + 2 * hkv) * d
        else:
            kernel_inputs = (hq + 2 * max(hkv, cp)) * d
        w.update(
            attn_q=hq * d,
            attn_kv=hkv * d,
            # all-gather KV: the kernel's q is the local one, and its output is already in the local layout (no
            # exchange back); the gathered row's k|v buffer (cp T tokens) is attn_kv_row, kept whole on every rank
            # by the attention's views of it. Ring: the local q and the rank's own k, v; the blocks in flight are
            # attn_kv_blocks.
            attn_gathered=kernel_inputs,
            attn_kv_row=2 * hkv * cp * d if gathered else 0,
            attn_kv_blocks=16 * hkv * d if ring else 0,
            attn_q_cp=hq * d if cp > 1 and not (gathered or ring) else 0,
            q_heads=hq,
            kv_heads=hkv,
        )
    if family == "qwen3_5":
        hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
        k, v = c.linear_key_head_dim, c.linear_value_head_dim
        w.update(
            gdn_conv=2 * hk * k + hv * v,
            gdn_k=hk * k,
            gdn_v=hv * v,
            gdn_vheads=hv,
            gdn_kheads=hk,
            gdn_chunk_a=hv * FLA_CHUNK,
            gdn_chunk_state=hv * k * v / FLA_CHUNK,
            gdn_through_v=hv * k if _passes_state_through(cp, rank) else 0,
        )
        rope = dict(getattr(c, "rope_parameters", None) or {})
        w["rotary"] = int(_head_dim(c) * rope.get("partial_rotary_factor", 1.0))
        if getattr(c, "num_experts", 0):
            k_top = c.num_experts_per_tok
            w.update(
                experts=c.num_experts,
                topk=k_top,
                topk_dim=k_top * c.hidden_size,
                topk_moe_inter=k_top * c.moe_intermediate_size,
                shared_inter=c.shared_expert_intermediate_size,
            )
    else:
        heads, p, g, n = c.mamba_num_heads, c.mamba_head_dim, c.n_groups, c.ssm_state_size
        inner = heads * p
        conv = inner + 2 * g * n
        head_parallel = mamba_cp_style == "a2a" and cp > 1
        w.update(
            mamba_in_proj=inner + conv + heads,
            mamba_conv=conv,
            mamba_conv_local=inner + 2 * max(g, cp) * n if head_parallel else conv,
            mamba_heads=heads,
            mamba_hn=heads * n,
            mamba_gn=g * n,
            mamba_hp=inner,
            mamba_groups=g,
            mamba_chunk_state=heads * p * n / FLA_CHUNK,
        )
        if "moe" in c.layers_block_type:
            k_top, dim = c.num_experts_per_tok, c.moe_latent_size or c.hidden_size
            w.update(
                experts=c.n_routed_experts,
                topk=k_top,
                topk_dim=k_top * dim,
                topk_moe_inter=k_top * c.moe_intermediate_size,
                shared_inter=c.moe_shared_expert_intermediate_size,
                latent=c.moe_latent_size or 0,
            )
    return w


def _term_bytes(terms: Mapping[str, float], widths: Mapping[str, float], elem: int) -> float:
    total = 0.0
    for name, coefficient in terms.items():
        base, size = name, elem
        for suffix, nbytes in (("_f32", 4), ("_i64", 8)):
            if name.endswith(suffix):
                base, size = name[: -len(suffix)], nbytes
        if base not in widths:
            raise KeyError(f"ACTIVATION_COEFFICIENTS uses width {base!r}, which layer_widths does not define")
        total += coefficient * widths[base] * size
    return total


def _parts(family: str, kind: str, cp: int, mamba_cp_style: str, rank: int | None = None) -> list[str]:
    """The coefficient entries one layer part is made of at this cp (and rank; None: the busiest)."""
    parts = [f"{family}.{kind}"]
    if family == "qwen3_5" and kind == "gdn" and _runs_prepass(cp, rank):
        parts.append("qwen3_5.gdn_prepass")
    if family == "nemotron_h" and kind == "mamba" and cp > 1 and mamba_cp_style == "state_passing":
        parts.append("nemotron_h.mamba_correction")
    return parts


# What an MLP keeps on top of its coefficients above when its down_proj carries a LoRA adapter: the recomputing
# Functions (cp_models.common.swiglu_linear / squared_relu_linear) need a bare nn.Linear, so the plain expression
# runs and autograd keeps silu(gate) and the product (relu(x) and its square).
PLAIN_MLP_EXTRA_SAVED: dict[str, dict[str, float]] = {
    "qwen3_5.mlp": {"intermediate": 2},
    "qwen3_5.moe": {"shared_inter": 2},
    "nemotron_h.mlp": {"intermediate": 1},
    "nemotron_h.moe": {"shared_inter": 1},
}


def activation_bytes_per_token(
    text_config,
    cp: int,
    elem: int = 2,
    mamba_cp_style: str = "state_passing",
    rank: int | None = None,
    attention_cp: str = "ulysses",
    plain_mlp: bool = False,
) -> dict[str, dict[str, float]]:
    """Bytes per local token, per layer part kind: ``{"gdn": {"saved": ..., "transient": ...}, ...}``, plus
    ``"block"`` (the norms around each layer) and ``"model"`` (once per model). ``rank``: a CP rank of one
    document spanning the row (the first runs GDN's pre-pass, the middle ones pass the state through, the last does
    neither); None is the busiest rank. ``plain_mlp``: the MLPs run the plain expression (LoRA on down_proj)."""
    family, widths = _family(text_config), layer_widths(text_config, cp, mamba_cp_style, rank, attention_cp)
    kinds = {k for pair in layer_kinds(text_config) for k in pair if k} | {"block", "model"}
    out = {}
    for kind in sorted(kinds):
        parts = _parts(family, kind, cp, mamba_cp_style, rank)
        out[kind] = {
            phase: sum(_term_bytes(ACTIVATION_COEFFICIENTS[p].get(phase, {}), widths, elem) for p in parts)
            for phase in ("saved", "transient")
        }
        if plain_mlp:
            extra = [PLAIN_MLP_EXTRA_SAVED[p] for p in parts if p in PLAIN_MLP_EXTRA_SAVED]
            out[kind]["saved"] += sum(_term_bytes(e, widths, elem) for e in extra)
    return out


def loss_workspace_bytes(
    vocab_size: int,
    hidden_size: int,
    local_tokens: int,
    elem_bytes: int,
    tile: tuple[int, int] | None = None,
    weight_grad: bool = True,
) -> float:
    """The tiled loss's backward peak (see ``LOSS_COEFFICIENTS``) over a shard of ``local_tokens`` tokens, with the
    models' tile (``cp_models.common.LOSS_TILE``) unless ``tile`` = (tokens, vocabulary entries). Without a weight
    gradient (a frozen LM head) the loss runs token-outer with no full-size accumulator."""
    tile_tokens, tile_vocab = loss_tile_shape(local_tokens, vocab_size, *(tile or (None, None)))
    c = LOSS_COEFFICIENTS
    if weight_grad:
        accumulator_rows, chunk_rows, gradient_rows = (
            min(local_tokens, vocab_size),
            max(tile_tokens, tile_vocab),
            local_tokens + vocab_size,
        )
    else:
        accumulator_rows, chunk_rows, gradient_rows = 0, tile_tokens, local_tokens
    return (
        tile_tokens * tile_vocab * (c["tile_f32"] * 4 + c["tile_act"] * elem_bytes)
        + c["accumulator_f32"] * accumulator_rows * hidden_size * 4
        + c["chunk_rows_f32"] * chunk_rows * hidden_size * 4
        + c["gradients_act"] * gradient_rows * hidden_size * elem_bytes
    )


# ----------------------------------------------------------------------------------------------------------
# Memory estimate


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank at the peak of one training step (the busiest rank, one document spanning the row).

    ``total`` is what ``torch.cuda.max_memory_allocated`` should show; ``needed`` adds :data:`HEADROOM`.
    """

    parameters: int
    """Weights: full replica in model.dtype, or FSDP's fp32 shards plus the gathered compute-dtype working copy."""
    gradients: int
    optimizer: int
    """AdamW exp_avg and exp_avg_sq of the trainable parameters (in the master weights' dtype)."""
    activations: int
    """Saved for backward: every layer's set, or with checkpointing every layer's input only."""
    loss_workspace: int
    """The tiled loss's backward: one tile of logits, its fp32 gradient accumulators and the two gradients."""
    layer_transient: int
    """The largest single layer's backward temporaries (with checkpointing: plus its recomputed saved set)."""
    headroom: int
    local_tokens: int
    activation_checkpointing: bool
    per_token: dict[str, dict[str, float]] = field(default_factory=dict)
    """Activation bytes per local token by layer kind (saved / transient)."""

    @property
    def workspace(self) -> int:
        """The backward workspace at the peak: the larger of the loss's and the largest layer's."""
        return max(self.loss_workspace, self.layer_transient)

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.workspace

    @property
    def needed(self) -> int:
        return self.total + self.headroom

    def gib(self) -> dict[str, float]:
        names = ("parameters", "gradients", "optimizer", "activations", "loss_workspace", "layer_transient")
        out = {n: getattr(self, n) / GIB for n in names}
        out.update(workspace=self.workspace / GIB, total=self.total / GIB, headroom=self.headroom / GIB)
        out["needed"] = self.needed / GIB
        return out


def estimate_memory(
    text_config,
    seq_len: int,
    cp: int,
    *,
    activation_checkpointing: bool,
    dtype: str = "bfloat16",
    optimizer: bool = True,
    fsdp_world: int = 1,
    lora: bool = False,
    fsdp: bool | None = None,
    mamba_cp_style: str = "state_passing",
    lora_targets: Sequence[str] | None = None,
    lora_rank: int = 8,
    vision_parameters: int = 0,
    rank: int | None = None,
    attention_cp: str = "ulysses",
) -> MemoryEstimate:
    """Memory per rank for one row of ``seq_len`` tokens over ``cp`` ranks (``T = seq_len / cp`` local tokens).

    ``fsdp`` (default: ``fsdp_world > 1``): FSDP2 over ``fsdp_world`` = dp x cp ranks with fp32 sharded master
    weights, gradients and AdamW state plus the working copy in ``dtype`` (what the trainer does with
    ``parallel.fsdp``); otherwise a full replica in ``dtype``. ``optimizer=False, fsdp_world=1`` is one
    forward + backward of a ``dtype`` model: weights and gradients in ``dtype``, no optimizer (the benchmark
    setting). ``lora``: only adapters (``lora_targets``, default the trainer's, rank ``lora_rank``) get gradients
    and optimizer state; activations are counted as for full fine-tuning (an upper bound), with the MLPs' plain
    expression where ``down_proj`` is a target. ``rank``: the estimate
    of that CP rank rather than the busiest (see :func:`activation_bytes_per_token`). ``attention_cp``: as
    ``parallel.attention_cp`` ("ulysses", the default, "kv_gather", "kv_ring" or "auto").
    """
    if seq_len % cp:
        raise ValueError(f"seq_len={seq_len} is not divisible by cp={cp}")
    elem = DTYPE_BYTES[dtype]
    fsdp = fsdp_world > 1 if fsdp is None else fsdp
    targets = None
    if lora:
        from sft_trainer.config import LoraConfig

        targets = list(lora_targets) if lora_targets is not None else LoraConfig().targets
    params = count_parameters(text_config, lora_targets=targets, lora_rank=lora_rank, vision=vision_parameters)
    trainable = params.trainable
    if fsdp:
        world = max(1, fsdp_world)
        root_trainable = 0 if lora else params.embeddings
        block_trainable = params.largest_block_lora if lora else params.largest_block
        parameters = (params.total + params.lora) * 4 / world + (
            params.embeddings + FSDP_GATHERED_BLOCKS * params.largest_block
        ) * elem
        gradients = trainable * 4 / world + root_trainable * elem + FSDP_GRADIENT_BLOCKS * block_trainable * (elem + 4)
        opt = 2 * trainable * 4 / world if optimizer else 0
    else:
        parameters = (params.total + params.lora) * elem
        gradients = trainable * elem
        opt = 2 * trainable * elem if optimizer else 0

    t = seq_len // cp
    if rank is not None and not 0 <= rank < cp:
        raise ValueError(f"rank={rank} is not a rank of cp={cp}")
    plain_mlp = bool(targets) and "down_proj" in targets  # an adapter on down_proj: the plain MLP expression
    per_token = activation_bytes_per_token(text_config, cp, elem, mamba_cp_style, rank, attention_cp, plain_mlp)
    blocks = []  # (saved, transient) per decoder block, bytes per local token
    for mixer, ffn in layer_kinds(text_config):
        common, mix = per_token["block"], per_token[mixer]
        saved = common["saved"] + mix["saved"]
        if ffn:  # the feed-forward's backward runs first; by the mixer's backward its saved set is gone
            ff = per_token[ffn]
            saved += ff["saved"]
            transient = common["transient"] + max(ff["transient"], mix["transient"] - ff["saved"])
        else:
            transient = common["transient"] + mix["transient"]
        blocks.append((saved, transient))
    model_saved = per_token["model"]["saved"]
    if activation_checkpointing:
        activations = t * (len(blocks) * text_config.hidden_size * elem + model_saved)
        layer = t * max(s + tr for s, tr in blocks)
    else:
        activations = t * (sum(s for s, _ in blocks) + model_saved)
        layer = t * max(tr for _, tr in blocks)
    vocab, hidden = text_config.vocab_size, text_config.hidden_size
    loss = loss_workspace_bytes(vocab, hidden, t, elem, weight_grad=not lora)  # LoRA: the LM head is frozen
    total = parameters + gradients + opt + activations + max(loss, layer)
    headroom = HEADROOM["fixed_gib"] * GIB + HEADROOM["fraction"] * total
    return MemoryEstimate(
        parameters=int(parameters),
        gradients=int(gradients),
        optimizer=int(opt),
        activations=int(activations),
        loss_workspace=int(loss),
        layer_transient=int(layer),
        headroom=int(headroom),
        local_tokens=t,
        activation_checkpointing=activation_checkpointing,
        per_token=per_token,
    )


def _min_seq_len(text_config, cp: int, mamba_cp_style: str) -> int:
    """The shortest row the conv halo allows at this cp (each shard holds at least W-1 tokens), a multiple of cp."""
    if cp == 1:
        return 1
    if _family(text_config) == "nemotron_h":
        if "linear_attention" not in text_config.layers_block_type or mamba_cp_style == "a2a":
            return cp
        halo = text_config.conv_kernel - 1
    else:
        if "linear_attention" not in text_config.layer_types[: text_config.num_hidden_layers]:
            return cp
        halo = text_config.linear_conv_kernel_dim - 1
    return cp * max(1, halo)


def longest_seq_len(text_config, cp: int, capacity_gib: float, **memory: Any) -> int:
    """The longest ``seq_len`` (a multiple of cp, at least the conv halo's minimum) whose :func:`estimate_memory`
    ``needed`` fits ``capacity_gib``; 0 when not even the shortest row fits. ``memory``: its keyword arguments."""
    capacity = capacity_gib * GIB
    style = memory.get("mamba_cp_style", "state_passing")
    low = _min_seq_len(text_config, cp, style) // cp  # in units of cp

    def fits(units: int) -> bool:
        return estimate_memory(text_config, units * cp, cp, **memory).needed <= capacity

    if not fits(low):
        return 0
    high = max(low, 1)
    while fits(high * 2):
        high *= 2
        if high > 1 << 40:  # nothing grows with seq_len: any length fits
            return high * cp
    lo, hi = high, high * 2  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * cp


# ----------------------------------------------------------------------------------------------------------
# Validity of a cp for a model


def valid_cp(text_config, cp: int, mamba_cp_style: str = "state_passing", attention_cp: str = "ulysses") -> str | None:
    """None when the model's heads allow this cp, else the rule that forbids it (cp_core's message)."""
    from cp_core import ContextParallelError
    from cp_core.head_parallel import check_head_parallel

    family = _family(text_config)
    types = text_config.layers_block_type if family == "nemotron_h" else text_config.layer_types
    try:
        attention_strategy(text_config, cp, attention_cp)
        if family == "nemotron_h" and "linear_attention" in types and mamba_cp_style == "a2a":
            check_head_parallel(
                text_config.mamba_num_heads, text_config.n_groups, cp, what="Mamba-2 head-parallel (a2a) CP"
            )
    except ContextParallelError as exc:
        return str(exc)
    return None


# ----------------------------------------------------------------------------------------------------------
# The plan of a config


def _text_config_of(cfg):
    """(text config, vision parameters, notes) of the config's model; presets take the shipped tokenizer's vocab."""
    from sft_trainer.config import is_vision_language, resolve_model_config

    vocab = None
    notes = []
    if cfg.model.path is None and cfg.model.config is None:
        vocab = _tokenizer_vocab(cfg.tokenizer_path)
    hf = resolve_model_config(cfg.model, vocab_size=vocab)
    vision = 0
    if is_vision_language(hf):
        import torch

        from cp_models import load_text_config
        from cp_vlm.qwen3_5_vl import build_vision_tower

        with torch.device("meta"):
            vision = sum(p.numel() for p in build_vision_tower(hf).parameters())
        notes.append("vision tower: parameters counted; its activations (image-dependent) are not")
        return load_text_config(hf), vision, notes
    if _family(hf) == "qwen3_5":
        from cp_models import load_text_config

        hf = load_text_config(hf)
    return hf, vision, notes


def _tokenizer_vocab(folder: str) -> int | None:
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path).get_vocab_size(with_added_tokens=True)


def _default_gpu_gib() -> float:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory / GIB
    except Exception:  # pragma: no cover - a broken CUDA setup plans for an H200
        pass
    return H200_GIB


_KIND_NAMES = {
    ("qwen3_5", "gdn"): ("linear_attention", "Gated DeltaNet"),
    ("qwen3_5", "attention"): ("full_attention", "gated softmax attention"),
    ("qwen3_5", "mlp"): ("mlp", "SwiGLU MLP"),
    ("qwen3_5", "moe"): ("moe", "sparse MoE"),
    ("nemotron_h", "mamba"): ("linear_attention", "Mamba-2"),
    ("nemotron_h", "attention"): ("full_attention", "attention"),
    ("nemotron_h", "mlp"): ("mlp", "squared-ReLU MLP"),
    ("nemotron_h", "moe"): ("moe", "MoE"),
}


def _layer_rows(
    text_config, seq_len: int, cp: int, style: str, elem: int, recompute: bool, per_token, attention_cp: str = "ulysses"
):
    family = _family(text_config)
    counts: dict[str, int] = {}
    kinds = layer_kinds(text_config)
    for kind in [m for m, _ in kinds] + [f for _, f in kinds if f]:  # token mixers first, then feed-forwards
        counts[kind] = counts.get(kind, 0) + 1
    rows = []
    for kind, count in counts.items():
        layer_type, name = _KIND_NAMES[(family, kind)]
        comm = "none"
        if kind == "attention":
            q, kv, d = text_config.num_attention_heads, text_config.num_key_value_heads, _head_dim(text_config)
            attention = attention_strategy(text_config, cp, attention_cp)
            if attention == "kv_gather":
                per_layer = kv_gather_attention_bytes(seq_len, cp, q, kv, d, elem, recompute=recompute)
                strategy, comm = "all-gather K|V of the row, half the queries swapped per rank pair", "all_gather"
            elif attention == "kv_ring":
                per_layer = kv_ring_attention_bytes(seq_len, cp, q, kv, d, elem, recompute=recompute)
                strategy, comm = "ring of K|V blocks, query halves swapped", "ring"
            else:
                per_layer = ulysses_attention_bytes(seq_len, cp, q, kv, d, elem, recompute=recompute)
                strategy, comm = f"Ulysses all-to-all, KV heads x{max(1, cp // kv)}", "all_to_all"
        elif kind == "gdn":
            per_layer = gdn_bytes(text_config, seq_len, cp, elem, recompute=recompute)
            strategy, comm = "conv halo + delta-rule state passing", "state_passing"
        elif kind == "mamba":
            per_layer = mamba_bytes(text_config, style, seq_len, cp, elem, recompute=recompute)
            if style == "a2a":
                g = text_config.n_groups
                groups = f", n_groups {g} -> {max(g, cp)} replicated" if g < cp else ""
                strategy, comm = f"head-parallel all-to-all{groups}", "all_to_all"
            else:
                strategy, comm = "conv halo + SSD state passing", "state_passing"
        else:
            per_layer, strategy = 0, "local (token-wise, no CP traffic)"
        if cp == 1 and comm != "none":
            strategy = f"{strategy} (inactive at cp=1)"
        rows.append(
            dict(
                kind=kind,
                layer_type=layer_type,
                name=name,
                count=count,
                strategy=strategy,
                comm=comm if cp > 1 else "none",
                bytes_per_layer=per_layer,
                bytes=per_layer * count,
                saved_bytes_per_token=per_token[kind]["saved"],
            )
        )
    return rows


def build_plan(cfg, *, gpu_memory_gib: float | None = None, nvlink_gbps: float = NVLINK_GBPS) -> dict[str, Any]:
    """The plan of a validated :class:`~sft_trainer.config.TrainConfig` as a JSON-able dict (see :func:`main`)."""
    from sft_trainer.config import model_family
    from sft_trainer.run import world_layout

    text, vision, notes = _text_config_of(cfg)
    family = model_family(text)
    style = cfg.parallel.resolve_cp_style(family)
    mamba_style = style if family == "nemotron_h" else "state_passing"
    attention_cp = cfg.parallel.attention_cp
    dp, cp = world_layout(cfg)
    seq_len = cfg.data.seq_len
    dtype = cfg.model.dtype
    elem = DTYPE_BYTES[dtype]
    ckpt = cfg.model.activation_checkpointing
    gpu = _default_gpu_gib() if gpu_memory_gib is None else gpu_memory_gib
    lora = cfg.train.lora

    def memory_kwargs(cp_: int, checkpointing: bool) -> dict[str, Any]:
        return dict(
            activation_checkpointing=checkpointing,
            dtype=dtype,
            optimizer=True,
            fsdp_world=dp * cp_,
            fsdp=cfg.parallel.fsdp,
            lora=lora.enabled,
            lora_targets=lora.targets,
            lora_rank=lora.rank,
            mamba_cp_style=mamba_style,
            vision_parameters=vision,
            attention_cp=attention_cp,
        )

    params = count_parameters(
        text, lora_targets=lora.targets if lora.enabled else None, lora_rank=lora.rank, vision=vision
    )
    memory = {
        name: estimate_memory(text, seq_len, cp, **memory_kwargs(cp, flag))
        for name, flag in (("no_checkpointing", False), ("checkpointing", True))
    }
    chosen = memory["checkpointing" if ckpt else "no_checkpointing"]
    rows = _layer_rows(text, seq_len, cp, mamba_style, elem, ckpt, chosen.per_token, attention_cp)
    total = sum(r["bytes"] for r in rows)
    kinds = ("state_passing", "all_to_all", "all_gather", "ring")
    shares = {kind: sum(r["bytes"] for r in rows if r["comm"] == kind) for kind in kinds}

    longest = {}
    for cp_ in sorted({*PLANNED_CPS, cp}):
        reason = valid_cp(text, cp_, mamba_style, attention_cp)
        entry: dict[str, Any] = {"cp": cp_, "valid": reason is None}
        if reason is None:
            for name, flag in (("no_checkpointing", False), ("checkpointing", True)):
                entry[name] = longest_seq_len(text, cp_, gpu, **memory_kwargs(cp_, flag))
        else:
            entry["reason"] = reason
        longest[cp_] = entry

    problems = []
    if chosen.needed > gpu * GIB:
        problems.append(
            _does_not_fit(text, cfg, dp, cp, gpu, chosen, memory_kwargs, longest, mamba_style, attention_cp)
        )
    return {
        "model": {
            "source": _source(cfg),
            "model_type": text.model_type,
            "family": family,
            "parameters": params.total,
            "parameters_by_kind": params.layers,
            "embeddings_parameters": params.embeddings,
            "trainable_parameters": params.trainable,
            "vision_parameters": vision,
        },
        "run": {
            "seq_len": seq_len,
            "cp": cp,
            "dp": dp,
            "local_tokens": seq_len // cp,
            "dtype": dtype,
            "cp_style": style,
            "attention_cp": attention_cp,
            "attention_strategy": attention_strategy(text, cp, attention_cp),
            "fsdp": cfg.parallel.fsdp,
            "fsdp_world": dp * cp if cfg.parallel.fsdp else 1,
            "activation_checkpointing": ckpt,
            "lora": lora.enabled,
            "grad_accum": cfg.train.grad_accum,
        },
        "layers": rows,
        "communication": {
            "bytes_per_row": total,
            "bytes_per_step": total * cfg.train.grad_accum * cfg.train.micro_batch_size,
            **{f"{kind}_bytes": shares[kind] for kind in kinds},
            **{f"{kind}_share": shares[kind] / total if total else 0.0 for kind in kinds},
            "nvlink_gbps": nvlink_gbps,
            "time_ms_per_row": total / (nvlink_gbps * 1e9) * 1e3,
            "recompute_included": ckpt,
        },
        "memory": {name: {**m.gib(), "local_tokens": m.local_tokens} for name, m in memory.items()},
        "gpu_memory_gib": gpu,
        "fits": not problems,
        "longest_seq_len": {str(k): v for k, v in longest.items()},
        "problems": problems,
        "notes": notes,
        "data": _data_packing(cfg),
    }


def _data_packing(cfg) -> dict[str, Any]:
    """The packing of the run's data from the token cache (``{"cached": False, ...}`` before a run has built it;
    ``{"error": ...}`` when the data or tokenizer cannot be read, which the run itself will report)."""
    from transformers import AutoTokenizer

    from sft_trainer.data import store_options
    from sft_trainer.data.lookup import cached_packing

    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path)
        processor = None
        if cfg.vision_language and cfg.processor_path:
            from sft_trainer.data import load_image_processor

            processor = load_image_processor(cfg.processor_path)
        return cached_packing(
            cfg.data_path, tokenizer, cfg.data.seq_len, image_processor=processor, **store_options(cfg.data)
        )
    except Exception as exc:  # the run reports data problems with their file and row; the plan only notes them
        return {"error": f"{type(exc).__name__}: {exc}"}


def _source(cfg) -> str:
    m = cfg.model
    return m.path or m.config or m.preset or "?"


def _does_not_fit(text, cfg, dp, cp, gpu, chosen, memory_kwargs, longest, style, attention_cp) -> str:
    seq_len, ckpt = cfg.data.seq_len, cfg.model.activation_checkpointing
    fixes = []
    if not ckpt:
        with_ckpt = estimate_memory(text, seq_len, cp, **memory_kwargs(cp, True))
        if with_ckpt.needed <= gpu * GIB:
            fixes.append(f"enable model.activation_checkpointing (then {with_ckpt.needed / GIB:.1f} GiB)")
    if cp > 1 and attention_strategy(text, cp, attention_cp) == "kv_gather":
        ring = estimate_memory(text, seq_len, cp, **{**memory_kwargs(cp, ckpt), "attention_cp": "kv_ring"})
        if ring.needed <= gpu * GIB:
            fixes.append(f"set parallel.attention_cp = 'kv_ring' (then {ring.needed / GIB:.1f} GiB)")
    for cp_ in range(cp + 1, 257):
        if seq_len % cp_ or seq_len < _min_seq_len(text, cp_, style) or valid_cp(text, cp_, style, attention_cp):
            continue
        m = estimate_memory(text, seq_len, cp_, **memory_kwargs(cp_, ckpt))
        if m.needed <= gpu * GIB:
            fixes.append(f"raise parallel.cp to {cp_} (then {m.needed / GIB:.1f} GiB)")
            break
    if not fixes:  # no single change fits: the smallest cp that fits with checkpointing and/or the ring
        fixes.extend(_combined_fix(text, seq_len, cp, ckpt, gpu, memory_kwargs, style, attention_cp))
    best = longest[cp]["checkpointing" if ckpt else "no_checkpointing"]
    if best:
        fixes.append(f"lower data.seq_len to {best}")
    if not fixes:
        fixed = (chosen.parameters + chosen.gradients + chosen.optimizer) / GIB
        fixes.append(
            f"nothing at this layout fits (parameters, gradients and optimizer state alone need {fixed:.1f} GiB): "
            "use more ranks with parallel.fsdp = true, or train.lora"
        )
    return (
        f"data.seq_len={seq_len} at parallel.cp={cp} does not fit: needs {chosen.needed / GIB:.1f} GiB per rank, "
        f"the GPU has {gpu:.1f} GiB; " + " / ".join(fixes)
    )


def _combined_fix(text, seq_len, cp, ckpt, gpu, memory_kwargs, style, attention_cp) -> list[str]:
    """The first layout that fits when no single change does: the smallest cp (this one or more) with activation
    checkpointing and/or ring attention, fewest changes first; [] if none up to cp 256."""
    for cp_ in range(cp, 257):
        if seq_len % cp_ or seq_len < _min_seq_len(text, cp_, style):
            continue
        options = [
            (ckpt_, attention) for ckpt_ in dict.fromkeys((ckpt, True)) for attention in (attention_cp, "kv_ring")
        ]
        for ckpt_, attention in sorted(options, key=lambda o: (o[0] != ckpt) + (o[1] != attention_cp)):
            changes = [
                *(["enable model.activation_checkpointing"] if ckpt_ != ckpt else []),
                *([f"set parallel.attention_cp = '{attention}'"] if attention != attention_cp else []),
                *([f"raise parallel.cp to {cp_}"] if cp_ != cp else []),
            ]
            if len(changes) < 2 or valid_cp(text, cp_, style, attention):
                continue  # single changes were tried already
            kwargs = {**memory_kwargs(cp_, ckpt_), "attention_cp": attention}
            needed = estimate_memory(text, seq_len, cp_, **kwargs).needed
            if needed <= gpu * GIB:
                return [" and ".join(changes) + f" (then {needed / GIB:.1f} GiB)"]
    return []


# ----------------------------------------------------------------------------------------------------------
# Output


def _size(nbytes: float) -> str:
    if nbytes == 0:
        return "0"
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def format_plan(plan: Mapping[str, Any]) -> str:
    """The plan as a plain-text report."""
    m, r, c = plan["model"], plan["run"], plan["communication"]
    out = []
    params = f"{m['parameters'] / 1e9:.3f}B parameters" if m["parameters"] >= 1e8 else f"{m['parameters']:,} parameters"
    trainable = f", {m['trainable_parameters']:,} trainable (LoRA)" if r["lora"] else ""
    out.append(f"sft-train plan: {m['source']} ({m['model_type']}), {params}{trainable}, {r['dtype']}")
    ranks = f"{r['fsdp_world']} rank{'s' if r['fsdp_world'] != 1 else ''}"
    layout = f"FSDP2 over {ranks}" if r["fsdp"] else "full replica per rank"
    out.append(
        f"  data.seq_len={r['seq_len']}, parallel.cp={r['cp']} ({r['local_tokens']} tokens a rank), dp={r['dp']}, "
        f"cp_style={r['cp_style']}, attention_cp={r['attention_cp']}"
        + (f" ({r['attention_strategy']})" if r["attention_strategy"] not in (None, r["attention_cp"]) else "")
        + f", {layout}, activation checkpointing {'on' if r['activation_checkpointing'] else 'off'}"
    )
    d = plan.get("data", {})
    if d.get("cached"):
        out.append(
            f"  data: {d['rows']} rows of {r['seq_len']} tokens, {d['documents']} documents, packing efficiency "
            f"{d['efficiency']:.2%} (padding {d['padding_tokens']} tokens; token cache {d['cache']})"
        )
    elif "cache" in d:
        out.append(
            f"  data: packing efficiency known once the token cache is built (the first run builds {d['cache']})"
        )
    elif "error" in d:
        out.append(f"  data: not read ({d['error']})")
    out.append("")
    out.append(
        f"CP traffic per rank for one row of {r['seq_len']} tokens, forward + backward (busiest rank, one document "
        f"spanning the row{'; recomputation re-sends the forward share' if c['recompute_included'] else ''})"
    )
    header = f"  {'layer type':42s} {'count':>5s}  {'CP strategy':48s} {'per layer':>11s} {'all layers':>11s} {'saved/token':>11s}"
    out.append(header)
    out.append("  " + "-" * (len(header) - 2))
    for row in plan["layers"]:
        label = f"{row['layer_type']} ({row['name']})"
        out.append(
            f"  {label:42s} {row['count']:5d}  {row['strategy']:48s} {_size(row['bytes_per_layer']):>11s} "
            f"{_size(row['bytes']):>11s} {_size(row['saved_bytes_per_token']):>11s}"
        )
    total = c["bytes_per_row"]
    out.append(
        f"  total per row: {_size(total)}; state passing {c['state_passing_share']:.1%}, all-to-all "
        f"{c['all_to_all_share']:.1%}, all-gather {c['all_gather_share']:.1%}, ring {c['ring_share']:.1%}; per "
        "optimizer step "
        f"({r['grad_accum']} rows): {_size(c['bytes_per_step'])}"
    )
    out.append(
        f"  time at {c['nvlink_gbps']:.0f} GB/s NVLink: {c['time_ms_per_row']:.4g} ms per row (a lower bound: no "
        "latency, no overlap; state passing's hops are sequential)"
    )
    out.append("")
    mem = plan["memory"]
    out.append(f"Memory per rank (GiB), busiest rank, {r['local_tokens']} local tokens")
    out.append(f"  {'':52s} {'no checkpointing':>17s} {'checkpointing':>14s}")
    weights = "fp32 shards + gathered working copy" if r["fsdp"] else f"{r['dtype']} replica"
    labels = [
        ("parameters", f"parameters ({weights})"),
        ("gradients", "gradients" + (" (fp32 shards + unsharded in backward)" if r["fsdp"] else "")),
        ("optimizer", "optimizer state (AdamW exp_avg, exp_avg_sq)"),
        ("activations", "activations saved for backward"),
        ("workspace", "backward workspace (max of loss, largest layer)"),
        ("total", "total (torch.cuda.max_memory_allocated)"),
        ("headroom", "headroom (CUDA context, NCCL, fragmentation)"),
        ("needed", "needed"),
    ]
    for key, label in labels:
        a, b = mem["no_checkpointing"][key], mem["checkpointing"][key]
        out.append(f"  {label:52s} {a:17.2f} {b:14.2f}")
    for key, label in (("loss_workspace", "  of which loss"), ("layer_transient", "  of which largest layer")):
        a, b = mem["no_checkpointing"][key], mem["checkpointing"][key]
        out.append(f"  {label:52s} {a:17.2f} {b:14.2f}")
    out.append(f"  GPU: {plan['gpu_memory_gib']:.1f} GiB")
    out.append("")
    out.append(f"Longest data.seq_len that fits {plan['gpu_memory_gib']:.1f} GiB (a multiple of cp)")
    out.append(f"  {'cp':>4s} {'no checkpointing':>17s} {'checkpointing':>14s}")
    for key, entry in plan["longest_seq_len"].items():
        if entry["valid"]:
            mark = "  <- this run" if int(key) == r["cp"] else ""
            out.append(f"  {key:>4s} {entry['no_checkpointing']:17d} {entry['checkpointing']:14d}{mark}")
        else:
            out.append(f"  {key:>4s} {'not valid: ' + entry['reason']}")
    for note in plan["notes"]:
        out.append(f"note: {note}")
    if plan["problems"]:
        out.append("")
        out.extend(f"DOES NOT FIT: {p}" for p in plan["problems"])
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------------------
# Command line


def split_config_argument(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """``--config FILE`` (or ``--config=FILE``), anywhere among the overrides -> (FILE or None, the overrides)."""
    from sft_trainer.config import ConfigError

    path, rest, argv = None, [], list(argv)
    i = 0
    while i < len(argv):
        token, found = argv[i], None
        if token == "--config":
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ConfigError("--config needs a value: --config FILE.toml (or a shipped config's name)")
            found, i = argv[i + 1], i + 2
        elif token.startswith("--config="):
            found, i = token.split("=", 1)[1], i + 1
        else:
            rest.append(token)
            i += 1
        if found is not None:
            if path is not None:
                raise ConfigError(f"--config given twice ({path!r} and {found!r}); give one file, then overrides")
            path = found
    return path, rest


_PLAN_OPTIONS = {"--nvlink-gbps": float, "--gpu-memory-gib": float}
PLAN_USAGE = (
    "Prints the run's CP strategy per layer type, bytes per step, memory per rank and the longest row that fits,\n"
    "from the config alone (nothing is built), and exits nonzero naming the reason when the run cannot work.\n"
    "Options besides the config keys: --json (machine-readable), --nvlink-gbps X (default 450, the bandwidth the\n"
    "communication time assumes), --gpu-memory-gib Y (default: this machine's GPU, else an H200's 139.8)."
)


def _split_plan_options(argv: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    options: dict[str, Any] = {"json": False}
    rest: list[str] = []
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        name, _, inline = token.partition("=")
        if token == "--json":
            options["json"] = True
        elif name in _PLAN_OPTIONS:
            raw = inline if inline else (tokens[i + 1] if i + 1 < len(tokens) else None)
            if not inline:
                i += 1
            try:
                value = _PLAN_OPTIONS[name](raw)
                if value <= 0:
                    raise ValueError
            except (TypeError, ValueError):
                raise SystemExit(f"sft-train plan: {name} takes a positive number, got {raw!r}") from None
            options[name[2:].replace("-", "_")] = value
        else:
            rest.append(token)
        i += 1
    return options, rest


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """``sft-train plan [--config FILE] [--section.key VALUE ...] [--json] [--nvlink-gbps X] [--gpu-memory-gib Y]``.

    Validates the config as training would, prints the plan (a table, or JSON with ``--json``) and exits nonzero
    naming the reason when the config is invalid or does not fit the GPU. Returns the plan dict."""
    from sft_trainer.config import ConfigError, load_config, wants_help

    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_help(argv):
        from sft_trainer.config import config_help

        print(config_help("sft-train plan", PLAN_USAGE, argv))
        return {}
    options, rest = _split_plan_options(argv)
    try:
        path, overrides = split_config_argument(rest)
        cfg = load_config(path, overrides, fetch_weights=False)  # a hub model: config and tokenizer suffice
        plan = build_plan(
            cfg, gpu_memory_gib=options.get("gpu_memory_gib"), nvlink_gbps=options.get("nvlink_gbps", NVLINK_GBPS)
        )
    except ConfigError as exc:
        raise SystemExit(f"sft-train plan: invalid configuration:\n{exc}") from None
    if options["json"]:
        print(json.dumps(plan, indent=1, default=_json_default))
    else:
        print(format_plan(plan))
    if plan["problems"]:
        raise SystemExit("sft-train plan: " + "\n".join(plan["problems"]))
    return plan


def _json_default(value: Any) -> Any:
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(f"cannot serialize {type(value).__name__}")


if __name__ == "__main__":
    main()
