"""Model structure from its config: layer kinds, linear layers, parameter counts (LoRA included)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def _family(config) -> str:
    """The model family's name (cp_models.families) of a text config."""
    from cp_models.families import family_for

    return family_for(config).name


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
