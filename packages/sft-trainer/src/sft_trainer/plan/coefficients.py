"""Memory coefficients of the planner: what each part of a layer keeps per local token, the loss, FSDP2, headroom."""

from __future__ import annotations

# Calibrate these against measured peaks.
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
    # through) do not exceed by more than the width.
    "qwen3_5.gdn_prepass": {"saved": {"gdn_vheads_f32": 1}, "transient": {}},
    # Gated softmax attention (torch varlen attention / flash, fla RMSNorm for q/k):
    #   hidden 1: normed input of q/k/v_proj; attn_q 5: q_proj's [query | gate] output (2, kept by q_norm, which
    #   reads a view of it), the attention output, sigmoid(gate), o_proj's input; attn_kv 1: k_proj's output
    #   (kept by k_norm); attn_gathered 1: q, k, v after the Ulysses exchange, (Hq + 2 max(Hkv, cp)) D (at cp 1 the
    #   rotated q, k and v); attn_q_cp 1: the output after the exchange back (cp > 1 only; at cp 1 it is the
    #   attention output itself); q_heads_f32 2: the softmax log-sum-exp and q_norm's rstd; kv_heads_f32 1: k_norm's.
    # Transient: dq/dk/dv in the gathered layout and their exchange buffers, the output gradient (attn_q 2: no
    # measured peak at 8 .. 16 ranks and 32k tokens a rank is the attention layer's; each equals the GDN-bound peak
    # within 0.05 GiB), fp32 dq accumulator.
    # All-gathered KV (attn_kv_row, 0 under Ulysses): the gathered row's k|v, saved 1; backward 0.3: the per-KV-head
    # key / value gradients over a rank's key range (one query head per kernel call, so flash-attn 2 never expands
    # them to [keys, Hq, D]), then the gather's one zeroed row buffer for the reduce-scatter once the saved row is
    # freed. Measured on the H200 (0.8B, 32k tokens a rank, middle rank): 1M / cp 32 and 2M / cp 64 peaked 2.2 and
    # 4.8 GiB above the 6.7 GiB of 512k / cp 16, for 2 and 4 GiB of row: 1.3 units; 512k / cp 16 (1 GiB) did not rise.
    # Ring-passed KV (cp_core.kv_ring; attn_kv_row 0): attn_gathered is the kernel's q (the swapped queries) and the
    # rank's own rotated k, v, (Hq + 2 Hkv) D, saved 1 with the fp32 log-sum-exp (q_heads_f32, as every path);
    # transient attn_kv_blocks 1, at most 16 Hkv D in the activation dtype: in backward the block in use and the one
    # arriving (2 x 2), the rank's fp32 share of the block's k / v gradients (4), the gradients received, the ones
    # still going out and the new ones (3 x 2). Modelled from the code; on the H200 (0.8B, 32k tokens a rank) 512k /
    # cp 16, 1M / cp 32 and 2M / cp 64 peak at 6.71 GiB each, the estimate 7.16 GiB.
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
    # are recomputed in backward, cp_models.feed_forward.swiglu_linear). Backward: silu(gate), then the product's
    # gradient, up's and gate's (at most 3 at once).
    "qwen3_5.mlp": {"saved": {"hidden": 1, "intermediate": 2}, "transient": {"intermediate": 3}},
    # Sparse MoE, grouped GEMM: hidden 2: the input (router, shared expert, its gate) and the shared expert's
    # output (kept by the gate multiply); experts_f32 1: the router softmax; topk_dim 2: tokens gathered per
    # expert slot and the expert outputs back in token order (kept by the weighted combine,
    # cp_models.feed_forward.combine_expert_outputs); topk_moe_inter 4: [gate | up] (2), silu(gate), the product;
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
    # cp_models.feed_forward.squared_relu_linear). Backward: relu(x), the gradient, 2 relu(x) (at most 3 at once).
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

# The tiled cross-entropy (cp_models.loss.token_log_probs): tiles of [tokens, vocabulary] logits (LOSS_TILE,
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

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
