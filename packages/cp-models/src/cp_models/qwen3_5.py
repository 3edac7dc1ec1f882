"""Qwen3.5 text models (dense and MoE) with context parallelism, HF-checkpoint compatible.

One readable file in the manner of transformers' modeling files. Parameter names match transformers', so a
checkpoint saved by ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` (or the text part of a VL checkpoint)
loads directly, and :meth:`Qwen35ForCausalLM.save_pretrained` writes one transformers loads back.

Layers: Gated DeltaNet (``linear_attention``), gated softmax attention (``full_attention``), SwiGLU MLP or sparse
MoE with a gated shared expert. Forward takes this rank's tokens of one packed row and the row's global document
lengths; attention runs Ulysses, all-gathered or ring-passed KV (cp_core.context_parallel_attention, chosen by
set_context_parallel_attributes), GDN the conv halo and state passing.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from cp_core import (
    AttentionBackend,
    ContextParallelError,
    CPTopology,
    GatedDecay,
    PackedRowMetadata,
    RecurrentBackend,
    causal_conv1d_cp,
    gated_delta_rule_cp,
)
from cp_models.activations import activation
from cp_models.config_rules import check_config_rules, check_multiple
from cp_models.context_parallel import ContextParallelAttention, ContextParallelModule
from cp_models.feed_forward import combine_expert_outputs, expert_slot_groups, sort_by_expert, swiglu_linear
from cp_models.hf_checkpoint import (
    load_hf_checkpoint,
    strip_prefixes,
    unwrapped_names,
    write_safetensors,
    written_dtype,
)
from cp_models.loss import CausalLMOutput, causal_lm_output
from cp_models.loss_tiles import TileKernels
from cp_models.norms import GatedRMSNorm, ZeroCenteredRMSNorm
from cp_models.row_inputs import build_row_metadata, embed_row, row_position_ids, validated_row_inputs

TEXT_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")
# the text config's sizes (each a positive integer where the config sets it)
SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)
VL_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")  # vision-language checkpoints: their text_config loads here
SUPPORTED_MODEL_TYPES = (*TEXT_MODEL_TYPES, *VL_MODEL_TYPES)
SILU = ("silu", "swish")  # the activation of the fused SwiGLU path and the only one GDN's conv takes


def load_text_config(path_or_config):
    """The text config of a Qwen3.5 checkpoint folder or config object (VL configs give their text_config)."""
    from transformers import AutoConfig, PretrainedConfig

    config = (
        path_or_config if isinstance(path_or_config, PretrainedConfig) else AutoConfig.from_pretrained(path_or_config)
    )
    if getattr(config, "text_config", None) is not None and config.model_type in VL_MODEL_TYPES:
        # A VL checkpoint ties its head by the top-level flag (transformers' VL model reads that one).
        tied = config.tie_word_embeddings
        config = copy.deepcopy(config.text_config)
        config.tie_word_embeddings = tied
    if config.model_type not in TEXT_MODEL_TYPES:
        raise ContextParallelError(f"not a Qwen3.5 config: model_type={config.model_type!r}")
    return config


# ----------------------------------------------------------------------------------------------------------
# Rotary embedding (partial, 3-D MRoPE with interleaved sections)


class Qwen35Rotary(nn.Module):
    def __init__(self, config):
        super().__init__()
        rope = dict(config.rope_parameters)
        rope_type = rope.get("rope_type", "default")
        if rope_type == "default":
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
            inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.attention_scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
        # A plain fp32 tensor, not a buffer: ``model.to(torch.bfloat16)`` would round a buffer to bf16, and rotary
        # angles of position p drift by p times that rounding (hundreds of radians at 32k tokens).
        self.inv_freq = inv_freq.float()
        self.mrope_section = list(rope.get("mrope_section", [11, 11, 10]))
        self.rope_type = rope_type
        self.rescaled_past = _rescaled_past(config, rope, rope_type)

    def check_document_lengths(self, meta: PackedRowMetadata) -> None:
        """Refuse a row whose longest document reaches the lengths where transformers recomputes this rope type's
        frequencies from the call's longest position (``dynamic``: growing with it, and kept between calls;
        ``longrope``: its long factors). That choice is per call, not per document, so no packed row reproduces
        it; ``meta`` is the same on every rank, so every rank raises together."""
        if self.rescaled_past is not None and meta.max_seqlen > self.rescaled_past:
            raise ContextParallelError(
                f"a document of {meta.max_seqlen} tokens is longer than {self.rescaled_past}, where "
                f"rope_type={self.rope_type!r} rescales its frequencies per call in transformers (not per "
                f"document): keep documents at most {self.rescaled_past} tokens, or use a checkpoint whose "
                "rope_parameters have a fixed rope_type"
            )

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [T] (text) or [3, T] (t, h, w) -> cos, sin [T, rotary_dim]."""
        if position_ids.dim() == 1:
            position_ids = position_ids.expand(3, -1)
        if self.inv_freq.device != position_ids.device:
            self.inv_freq = self.inv_freq.to(position_ids.device)
        freqs = position_ids[..., None].float() * self.inv_freq  # [3, T, dim/2]
        mixed = freqs[0].clone()
        for axis, offset in ((1, 1), (2, 2)):  # height and width take interleaved frequency slots
            idx = slice(offset, self.mrope_section[axis] * 3, 3)
            mixed[..., idx] = freqs[axis, ..., idx]
        emb = torch.cat([mixed, mixed], dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def _rescaled_past(config, rope: dict, rope_type: str) -> int | None:
    """The document length past which transformers recomputes ``rope_type``'s frequencies at run time, or None."""
    if "dynamic" in rope_type:
        return config.max_position_embeddings
    if rope_type == "longrope":
        return rope.get("original_max_position_embeddings") or config.max_position_embeddings
    return None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; rotates the first ``cos.size(-1)`` dims of each head."""
    rot = cos.size(-1)
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat([x_rot * cos + _rotate_half(x_rot) * sin, x_pass], dim=-1)


# ----------------------------------------------------------------------------------------------------------
# Token mixers


class Qwen35Attention(ContextParallelAttention):
    """Gated softmax attention: q_proj emits query and gate, q/k RMSNorm, partial rotary, GQA; Ulysses,
    all-gathered or ring-passed KV under CP."""

    def __init__(
        self, config, attention_backend: AttentionBackend = "auto", recurrent_backend: RecurrentBackend = "auto"
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scaling = self.head_dim**-0.5
        self.attention_backend = attention_backend
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, eps=config.rms_norm_eps, backend=recurrent_backend)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, eps=config.rms_norm_eps, backend=recurrent_backend)

    def forward(self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], meta: PackedRowMetadata):
        t = hidden.size(0)
        query, gate = self.q_proj(hidden).view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        query = self.q_norm(query)
        key = self.k_norm(self.k_proj(hidden).view(t, self.num_kv_heads, self.head_dim))
        value = self.v_proj(hidden).view(t, self.num_kv_heads, self.head_dim)
        cos, sin = rotary
        query, key = apply_partial_rotary(query, cos, sin), apply_partial_rotary(key, cos, sin)
        out = self.attend(query, key, value, meta, self.scaling)
        out = out.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))
        return self.o_proj(out)


def check_gdn_activation(hidden_act: str) -> None:
    """Raise unless ``hidden_act`` is one the Gated DeltaNet conv runs (silu, as transformers' fast path)."""
    if hidden_act not in SILU:
        raise ContextParallelError(
            f"hidden_act={hidden_act!r}: Qwen3.5's Gated DeltaNet conv runs silu only (as transformers' fast path "
            "does); use a checkpoint with hidden_act 'silu', or one without linear_attention layers"
        )


class Qwen35GatedDeltaNet(ContextParallelModule):
    """Gated DeltaNet: causal conv over q|k|v, gated delta rule with L2-normed q/k, gated RMSNorm, out_proj."""

    def __init__(self, config, recurrent_backend: RecurrentBackend = "auto"):
        super().__init__()
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        check_multiple(config, "linear_num_value_heads", "linear_num_key_heads")
        check_gdn_activation(config.hidden_act)
        self.recurrent_backend = recurrent_backend
        conv_dim = 2 * self.key_dim + self.value_dim
        width = config.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, width, groups=conv_dim, padding=width - 1, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.log(torch.empty(self.num_v_heads).uniform_(0.01, 16)))
        self.norm = GatedRMSNorm(self.head_v_dim, eps=config.rms_norm_eps, backend=recurrent_backend)
        self.out_proj = nn.Linear(self.value_dim, config.hidden_size, bias=False)
        self.in_proj_qkv = nn.Linear(config.hidden_size, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(config.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(config.hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(config.hidden_size, self.num_v_heads, bias=False)

    def forward(self, hidden: torch.Tensor, meta: PackedRowMetadata) -> torch.Tensor:
        t = hidden.size(0)
        mixed = causal_conv1d_cp(
            self.in_proj_qkv(hidden),
            self.conv1d.weight.squeeze(1),
            None,
            meta,
            self.cp_topology,
            activation="silu",
            backend=self.recurrent_backend,
        )
        query, key, value = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = query.reshape(t, self.num_k_heads, self.head_k_dim)
        key = key.reshape(t, self.num_k_heads, self.head_k_dim)
        value = value.reshape(t, self.num_v_heads, self.head_v_dim)
        # The decay goes in as its inputs: fla computes it inside its chunk kernel.
        decay = GatedDecay(self.in_proj_a(hidden), self.A_log, self.dt_bias)
        beta = self.in_proj_b(hidden).sigmoid()
        out = gated_delta_rule_cp(
            query, key, value, decay, beta, meta, self.cp_topology, qk_l2norm=True, backend=self.recurrent_backend
        )
        z = self.in_proj_z(hidden).view(t, self.num_v_heads, self.head_v_dim)
        out = self.norm(out.to(hidden.dtype), z).reshape(t, self.value_dim)
        return self.out_proj(out)


# ----------------------------------------------------------------------------------------------------------
# Feed-forward


class Qwen35MLP(nn.Module):
    """``down(act(gate(x)) * up(x))``; with silu (every released Qwen3.5) the recomputing SwiGLU path."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, backend: RecurrentBackend = "auto", hidden_act: str = "silu"
    ):
        super().__init__()
        self.backend = backend  # anything but "torch": the SwiGLU Triton kernels on CUDA
        self.hidden_act = hidden_act
        self.act_fn = activation(hidden_act)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.hidden_act not in SILU:
            return self.reference(x)
        return swiglu_linear(self.gate_proj(x), self.up_proj(x), self.down_proj, self.backend)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The plain expression, whose autograd keeps act(gate) and the product too."""
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Qwen35Router(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.linear(x, self.weight).float().softmax(-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype), experts


class Qwen35Experts(nn.Module):
    """Experts as stacked weights: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I].

    On CUDA with torch's grouped GEMM, tokens are sorted by expert and each projection is one grouped matmul;
    elsewhere a loop over the experts that received tokens computes the same thing exactly.
    """

    def __init__(self, config):
        super().__init__()
        self.num_experts, inter = config.num_experts, config.moe_intermediate_size
        self.act_fn = activation(config.hidden_act)
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * inter, config.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, config.hidden_size, inter))

    def _grouped(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        order, counts = sort_by_expert(experts, self.num_experts)
        token = order // experts.size(1)
        offsets = counts.cumsum(0).to(torch.int32)
        h = F.grouped_mm(x[token], self.gate_up_proj.transpose(1, 2), offs=offsets)
        gate, up = h.chunk(2, dim=-1)
        h = F.grouped_mm(self.act_fn(gate) * up, self.down_proj.transpose(1, 2), offs=offsets)
        return combine_expert_outputs(h, order, weights, x.dtype)

    def _looped(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e, token, slot in expert_slot_groups(experts, self.num_experts):
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            h = F.linear(self.act_fn(gate) * up, self.down_proj[e]) * weights[token, slot, None]
            out.index_add_(0, token, h.to(x.dtype))
        return out

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        grouped = x.is_cuda and x.dtype == torch.bfloat16 and hasattr(F, "grouped_mm")
        return (self._grouped if grouped else self._looped)(x, experts, weights)


class Qwen35SparseMoeBlock(nn.Module):
    def __init__(self, config, backend: RecurrentBackend = "auto"):
        super().__init__()
        self.gate = Qwen35Router(config)
        self.experts = Qwen35Experts(config)
        inter = config.shared_expert_intermediate_size
        self.shared_expert = Qwen35MLP(config.hidden_size, inter, backend, config.hidden_act)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x)
        routed = self.experts(x, experts, weights)
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


# ----------------------------------------------------------------------------------------------------------
# Model


class Qwen35DecoderLayer(nn.Module):
    def __init__(
        self, config, layer_idx: int, attention_backend: AttentionBackend, recurrent_backend: RecurrentBackend
    ):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = Qwen35GatedDeltaNet(config, recurrent_backend)
        elif self.layer_type == "full_attention":
            self.self_attn = Qwen35Attention(config, attention_backend, recurrent_backend)
        else:
            raise ContextParallelError(f"unknown Qwen3.5 layer type {self.layer_type!r} at layer {layer_idx}")
        if getattr(config, "num_experts", 0):
            self.mlp = Qwen35SparseMoeBlock(config, recurrent_backend)
        else:
            self.mlp = Qwen35MLP(config.hidden_size, config.intermediate_size, recurrent_backend, config.hidden_act)
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps, recurrent_backend)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps, recurrent_backend)

    def forward(self, hidden: torch.Tensor, rotary, meta: PackedRowMetadata) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        if self.layer_type == "linear_attention":
            hidden = hidden + self.linear_attn(normed, meta)
        else:
            hidden = hidden + self.self_attn(normed, rotary, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Qwen35TextModel(nn.Module):
    def __init__(
        self, config, attention_backend: AttentionBackend = "auto", recurrent_backend: RecurrentBackend = "auto"
    ):
        super().__init__()
        check_config_rules(config, SIZE_FIELDS)
        # transformers' padding_idx: the pad token's row gets no gradient
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, getattr(config, "pad_token_id", None))
        self.layers = nn.ModuleList(
            Qwen35DecoderLayer(config, i, attention_backend, recurrent_backend) for i in range(config.num_hidden_layers)
        )
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, eps=config.rms_norm_eps, backend=recurrent_backend)
        self.rotary_emb = Qwen35Rotary(config)

    def forward(self, embeds: torch.Tensor, position_ids: torch.Tensor, meta: PackedRowMetadata) -> torch.Tensor:
        self.rotary_emb.check_document_lengths(meta)
        rotary = self.rotary_emb(position_ids, embeds.dtype)
        hidden = embeds
        for layer in self.layers:
            hidden = layer(hidden, rotary, meta)
        return self.norm(hidden)


@torch.no_grad()
def init_qwen35_weights(root: nn.Module, std: float) -> None:
    """transformers' initialization of the Qwen3.5 text modules under ``root``: normal(0, std) for projections,
    embeddings and experts, zero biases and padding rows; norms and the GDN decay parameters keep the values their
    modules set."""
    for module in root.modules():
        if isinstance(module, (nn.Linear, nn.Embedding, nn.Conv1d)):
            module.weight.normal_(0.0, std)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
            if getattr(module, "padding_idx", None) is not None:
                module.weight[module.padding_idx].zero_()
        elif isinstance(module, Qwen35Experts):
            module.gate_up_proj.normal_(0.0, std)
            module.down_proj.normal_(0.0, std)


class Qwen35ForCausalLM(nn.Module):
    """Qwen3.5 (dense or MoE) causal LM over one packed row, with or without context parallelism.

    ``forward(input_ids [T], seq_lens)``: ``input_ids`` are this rank's tokens (the whole row without CP),
    ``seq_lens`` the row's global document lengths. Positions restart at every document start unless
    ``position_ids`` ([T] or MRoPE [3, T], this rank's slice) are given. With ``labels`` (this rank's targets,
    already aligned to positions, < 0 to ignore) the output carries per-token log-probs computed without building
    [T, vocab] logits.
    """

    cp_topology: CPTopology = CPTopology.single()  # set once by set_context_parallel_attributes
    loss_tile_kernels: TileKernels = "auto"  # the loss tiles' passes: Triton kernels on CUDA, else torch

    def __init__(
        self, config, attention_backend: AttentionBackend = "auto", recurrent_backend: RecurrentBackend = "auto"
    ):
        super().__init__()
        config = load_text_config(config)
        self.config = config
        self.model = Qwen35TextModel(config, attention_backend, recurrent_backend)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.init_weights()

    def init_weights(self) -> None:
        """transformers' initialization (see :func:`init_qwen35_weights`)."""
        init_qwen35_weights(self, self.config.initializer_range)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        seq_lens: Sequence[int] | torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        return_logits: bool | None = None,
        loss_chunk_size: int | None = None,
    ) -> CausalLMOutput:
        inputs, device = (input_ids, inputs_embeds, position_ids, labels), self.model.embed_tokens.weight.device
        tokens, problem = validated_row_inputs(*inputs, vocab_size=self.lm_head.out_features)
        # First: every rank got the same row and no rank's inputs failed, so nothing below raises on one rank alone.
        meta = build_row_metadata(seq_lens, tokens, self.cp_topology, device, inputs=inputs, problem=problem)
        embeds = embed_row(self.model.embed_tokens, input_ids, inputs_embeds)
        hidden = self.model(embeds, row_position_ids(position_ids, meta).to(embeds.device), meta)
        return causal_lm_output(hidden, self.lm_head, labels, return_logits, loss_chunk_size, self.loss_tile_kernels)

    def decoder_layers(self) -> nn.ModuleList:
        """The decoder blocks (what activation checkpointing, compile and FSDP wrap one by one)."""
        return self.model.layers

    # -- HF checkpoints --------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: torch.dtype | None = None,
        attention_backend: AttentionBackend = "auto",
        recurrent_backend: RecurrentBackend = "auto",
    ) -> Qwen35ForCausalLM:
        """Load a transformers Qwen3.5 checkpoint folder (text or VL; single or sharded safetensors) in ``dtype``, or
        with None in transformers' ``"auto"`` dtype (the config's, else the checkpoint's)."""
        config = load_text_config(str(path))
        with torch.device("meta"):
            model = cls(config, attention_backend, recurrent_backend)
        tied = ("lm_head.weight", "model.embed_tokens.weight") if config.tie_word_embeddings else None
        to_ours = functools.partial(hf_to_cp_state, config=config)
        dtype = load_hf_checkpoint(
            model, path, to_ours, tied=tied, dtype=dtype, config_dtype=getattr(config, "dtype", None)
        )
        model.model.rotary_emb = Qwen35Rotary(config)  # buffers were on the meta device
        return model.to(dtype)

    def save_pretrained(self, path: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Write a checkpoint folder that transformers' Qwen3_5(Moe)ForCausalLM loads.

        ``state_dict``: the weights to write instead of this module's own (e.g. gathered from FSDP shards).
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        config = copy.deepcopy(self.config)  # the architectures written are the file's, not this model's config's
        config.architectures = ["Qwen3_5MoeForCausalLM" if getattr(config, "num_experts", 0) else "Qwen3_5ForCausalLM"]
        state = cp_to_hf_state(unwrapped_names(self.state_dict() if state_dict is None else state_dict), config)
        config.dtype = written_dtype(state)
        config.save_pretrained(path)
        write_safetensors(state, path)


def hf_to_cp_state(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """transformers checkpoint names -> ours: VL prefixes, per-expert weights stacked, MTP weights dropped."""
    state = strip_prefixes(state, [("model.language_model.", "model."), ("language_model.", "model.")])
    state = {n: t for n, t in state.items() if not n.startswith(("mtp.", "model.visual.", "visual."))}
    experts = getattr(config, "num_experts", 0)
    if not experts:
        return state
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts."
        names = [f"{prefix}{e}.{proj}.weight" for e in range(experts) for proj in ("gate_proj", "up_proj", "down_proj")]
        missing = [n for n in names if n not in state]
        if len(missing) == len(names):  # stacked (gate_up_proj / down_proj) or absent: checked by the caller
            continue
        if missing:
            raise ContextParallelError(f"checkpoint lacks {len(missing)} per-expert tensors, e.g. {missing[:5]}")
        gates = [state.pop(f"{prefix}{e}.gate_proj.weight") for e in range(experts)]
        ups = [state.pop(f"{prefix}{e}.up_proj.weight") for e in range(experts)]
        downs = [state.pop(f"{prefix}{e}.down_proj.weight") for e in range(experts)]
        state[f"{prefix}gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gates, ups, strict=True)])
        state[f"{prefix}down_proj"] = torch.stack(downs)
    return state


def cp_to_hf_state(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Ours -> transformers checkpoint names (per-expert weights, as transformers itself saves them)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            for e, w in enumerate(tensor):
                gate, up = w.chunk(2)
                out[f"{prefix}{e}.gate_proj.weight"] = gate
                out[f"{prefix}{e}.up_proj.weight"] = up
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e, w in enumerate(tensor):
                out[f"{prefix}{e}.down_proj.weight"] = w
        else:
            out[name] = tensor
    return out
