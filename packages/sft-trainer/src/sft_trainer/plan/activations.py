"""Activation bytes per local token of each layer part, and the tiled loss's backward workspace."""

from __future__ import annotations

from collections.abc import Mapping

from cp_models.loss import loss_tile_shape
from sft_trainer.plan.coefficients import ACTIVATION_COEFFICIENTS, FLA_CHUNK, LOSS_COEFFICIENTS
from sft_trainer.plan.parameters import _family, _head_dim, layer_kinds
from sft_trainer.plan.validity import attention_strategy


def _passes_state_through(cp: int, rank: int | None) -> bool:
    """Whether the recurrent state passes through this rank (one document spanning the row): a middle rank; the
    busiest rank (``rank`` None) is one whenever cp > 2."""
    return cp > 2 if rank is None else 0 < rank < cp - 1


def _runs_prepass(cp: int, rank: int | None) -> bool:
    """Whether this rank runs GDN's pre-pass (its last document continues on the next rank): all but the last."""
    return cp > 1 and (rank is None or rank < cp - 1)


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
# Functions (cp_models.feed_forward.swiglu_linear / squared_relu_linear) need a bare nn.Linear, so the plain expression
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
    models' tile (``cp_models.loss.LOSS_TILE``) unless ``tile`` = (tokens, vocabulary entries). Without a weight
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
