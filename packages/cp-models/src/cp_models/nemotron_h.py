"""Nemotron-H (hybrid Mamba-2 / attention / MLP / MoE) with context parallelism, HF-checkpoint compatible.

The modeling file in the manner of transformers', with the Mamba-2 mixer beside it. Parameter names match transformers'
``NemotronHForCausalLM`` in memory; checkpoints are read and written in the layout transformers itself saves
(``backbone.`` prefix, one tensor per expert), so a checkpoint saved by transformers loads directly and
:meth:`NemotronHForCausalLM.save_pretrained` writes one transformers loads back.

Every block is ``x + mixer(RMSNorm(x))`` with one mixer chosen by ``config.layers_block_type`` (from
``hybrid_override_pattern``: M = Mamba-2, * = attention, - = MLP, E = MoE). Forward takes this rank's tokens of
one packed row and the row's global document lengths. Attention runs Ulysses, all-gathered or ring-passed KV
(cp_core.context_parallel_attention, chosen by set_context_parallel_attributes). Mamba-2 runs one of two CP
strategies, chosen per model with ``mamba_cp_style`` (:mod:`cp_models.nemotron_h_mamba`).
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from cp_core import (
    AttentionBackend,
    ContextParallelError,
    CPTopology,
    PackedRowMetadata,
    RecurrentBackend,
)
from cp_models.activations import ReLUSquared, activation
from cp_models.config_rules import check_config_rules, check_multiple
from cp_models.context_parallel import ContextParallelAttention
from cp_models.feed_forward import combine_expert_outputs, expert_slot_groups, sort_by_expert, squared_relu_linear
from cp_models.hf_checkpoint import (
    load_hf_checkpoint,
    strip_prefixes,
    unwrapped_names,
    write_safetensors,
    written_dtype,
)
from cp_models.loss import CausalLMOutput, causal_lm_output
from cp_models.loss_tiles import TileKernels
from cp_models.nemotron_h_mamba import MambaCPStyle, NemotronHMamba2Mixer
from cp_models.row_inputs import build_row_metadata, embed_row, validated_row_inputs

MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
FP32_ROUTER = (".mixer.gate.weight", ".mixer.gate.e_score_correction_bias")  # fp32 strictly in transformers
# the config's sizes (each a positive integer where the config sets it)
SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "mamba_num_heads",
    "mamba_head_dim",
    "n_groups",
    "ssm_state_size",
    "conv_kernel",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "moe_shared_expert_intermediate_size",
    "n_group",
    "topk_group",
)


def load_nemotron_h_config(path_or_config):
    """The ``NemotronHConfig`` of a checkpoint folder or config object."""
    from transformers import AutoConfig, PretrainedConfig

    config = (
        path_or_config if isinstance(path_or_config, PretrainedConfig) else AutoConfig.from_pretrained(path_or_config)
    )
    if config.model_type != "nemotron_h":
        raise ContextParallelError(f"not a Nemotron-H config: model_type={config.model_type!r}")
    return config


class NemotronHRMSNorm(nn.Module):
    """``w * x / rms(x)`` in fp32 (the weight multiplies before the cast back, as in transformers)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * y).to(x.dtype)


# ----------------------------------------------------------------------------------------------------------
# Token mixers


class NemotronHAttention(ContextParallelAttention):
    """Grouped-query softmax attention without positional encoding or biases (as transformers' Nemotron-H);
    Ulysses, all-gathered or ring-passed KV under CP."""

    def __init__(self, config, attention_backend: AttentionBackend = "auto"):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scaling = self.head_dim**-0.5
        self.attention_backend = attention_backend
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor, meta: PackedRowMetadata) -> torch.Tensor:
        t = hidden.size(0)
        query = self.q_proj(hidden).view(t, self.num_heads, self.head_dim)
        key = self.k_proj(hidden).view(t, self.num_kv_heads, self.head_dim)
        value = self.v_proj(hidden).view(t, self.num_kv_heads, self.head_dim)
        out = self.attend(query, key, value, meta, self.scaling)
        return self.o_proj(out.reshape(t, -1))


# ----------------------------------------------------------------------------------------------------------
# Feed-forward


class NemotronHMLP(nn.Module):
    """``down(act(up(x)))``, no gate; act is squared ReLU in the released models."""

    def __init__(self, config, intermediate_size: int | None = None):
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        self.up_proj = nn.Linear(config.hidden_size, inter, bias=config.mlp_bias)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = activation(config.mlp_hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.act_fn, ReLUSquared):  # relu(x)^2 recomputed in backward, not kept
            return squared_relu_linear(self.up_proj(x), self.down_proj)
        return self.reference(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))


class NemotronHTopkRouter(nn.Module):
    """Sigmoid router (DeepSeek-V3 style): experts chosen by ``sigmoid(logits) + e_score_correction_bias``
    within the ``topk_group`` best of ``n_group`` groups (a group scores the sum of its two best experts);
    weights are the chosen plain sigmoid scores, optionally renormalized, times ``routed_scaling_factor``.
    Computed in fp32 with fp32 weights (transformers keeps them fp32 whatever the model dtype)."""

    def __init__(self, config):
        super().__init__()
        self.top_k, self.num_experts = config.num_experts_per_tok, config.n_routed_experts
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob, self.routed_scaling_factor = config.norm_topk_prob, config.routed_scaling_factor
        check_multiple(config, "n_routed_experts", "n_group")
        self.weight = nn.Parameter(torch.zeros(self.num_experts, config.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] fp32, experts [T, k])."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        if self.n_group > 1:
            grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
            best_groups = grouped.topk(2, dim=-1)[0].sum(-1).topk(self.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)
            choice = choice.masked_fill(~keep.repeat_interleave(self.num_experts // self.n_group, dim=1), -math.inf)
        experts = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, experts


class NemotronHExperts(nn.Module):
    """Non-gated experts as stacked weights: up_proj [E, I, H_in], down_proj [E, H_in, I] (H_in is the latent
    size when the MoE projects to one).

    On CUDA bf16 with torch's grouped GEMM, tokens are sorted by expert and each projection is one grouped matmul;
    elsewhere a loop over the experts that received tokens computes the same thing exactly. The routed sum is
    accumulated in the routing weights' fp32, as transformers does.
    """

    def __init__(self, config):
        super().__init__()
        self.num_experts, inter = config.n_routed_experts, config.moe_intermediate_size
        dim = config.moe_latent_size or config.hidden_size
        self.up_proj = nn.Parameter(torch.empty(self.num_experts, inter, dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, dim, inter))
        self.act_fn = activation(config.mlp_hidden_act)

    def _grouped(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        order, counts = sort_by_expert(experts, self.num_experts)
        token = order // experts.size(1)
        offsets = counts.cumsum(0).to(torch.int32)
        h = self.act_fn(F.grouped_mm(x[token], self.up_proj.transpose(1, 2), offs=offsets))
        h = F.grouped_mm(h, self.down_proj.transpose(1, 2), offs=offsets)
        return combine_expert_outputs(h, order, weights, x.dtype)

    def _looped(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x, dtype=weights.dtype)
        for e, token, slot in expert_slot_groups(experts, self.num_experts):
            h = F.linear(self.act_fn(F.linear(x[token], self.up_proj[e])), self.down_proj[e])
            out.index_add_(0, token, (h * weights[token, slot, None]).to(out.dtype))
        return out.to(x.dtype)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        grouped = x.is_cuda and x.dtype == torch.bfloat16 and hasattr(F, "grouped_mm")
        return (self._grouped if grouped else self._looped)(x, experts, weights)


class NemotronHMoE(nn.Module):
    """Routed experts (optionally through a latent projection) plus one always-on shared expert."""

    def __init__(self, config):
        super().__init__()
        self.experts = NemotronHExperts(config)
        self.gate = NemotronHTopkRouter(config)
        self.shared_experts = NemotronHMLP(config, config.moe_shared_expert_intermediate_size)
        if config.moe_latent_size is not None:
            self.fc1_latent_proj = nn.Linear(config.hidden_size, config.moe_latent_size, bias=config.mlp_bias)
            self.fc2_latent_proj = nn.Linear(config.moe_latent_size, config.hidden_size, bias=config.mlp_bias)
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x)
        routed = self.fc2_latent_proj(self.experts(self.fc1_latent_proj(x), experts, weights))
        return routed + self.shared_experts(x)


# ----------------------------------------------------------------------------------------------------------
# Model


class NemotronHBlock(nn.Module):
    """``x + mixer(RMSNorm(x))``. ``config.residual_in_fp32`` is not read: transformers' Nemotron-H ignores it
    too (the residual stays in the model dtype)."""

    def __init__(
        self,
        config,
        layer_idx: int,
        attention_backend: AttentionBackend,
        recurrent_backend: RecurrentBackend,
        mamba_cp_style: MambaCPStyle,
    ):
        super().__init__()
        self.block_type = config.layers_block_type[layer_idx]
        self.norm = NemotronHRMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        if self.block_type == MAMBA:
            self.mixer = NemotronHMamba2Mixer(config, recurrent_backend, mamba_cp_style)
        elif self.block_type == ATTENTION:
            self.mixer = NemotronHAttention(config, attention_backend)
        elif self.block_type == MLP:
            self.mixer = NemotronHMLP(config)
        elif self.block_type == MOE:
            self.mixer = NemotronHMoE(config)
        else:
            raise ContextParallelError(f"unknown Nemotron-H block type {self.block_type!r} at layer {layer_idx}")

    def forward(self, hidden: torch.Tensor, meta: PackedRowMetadata) -> torch.Tensor:
        normed = self.norm(hidden.to(self.norm.weight.dtype))
        if self.block_type in (MAMBA, ATTENTION):
            return hidden + self.mixer(normed, meta)
        return hidden + self.mixer(normed)


class NemotronHModel(nn.Module):
    def __init__(
        self,
        config,
        attention_backend: AttentionBackend = "auto",
        recurrent_backend: RecurrentBackend = "auto",
        mamba_cp_style: MambaCPStyle = "state_passing",
    ):
        super().__init__()
        check_config_rules(config, SIZE_FIELDS)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            NemotronHBlock(config, i, attention_backend, recurrent_backend, mamba_cp_style)
            for i in range(len(config.layers_block_type))
        )
        self.norm_f = NemotronHRMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, embeds: torch.Tensor, meta: PackedRowMetadata) -> torch.Tensor:
        hidden = embeds
        for layer in self.layers:
            hidden = layer(hidden, meta)
        return self.norm_f(hidden)


class NemotronHForCausalLM(nn.Module):
    """Nemotron-H causal LM over one packed row, with or without context parallelism.

    ``forward(input_ids [T], seq_lens)``: ``input_ids`` are this rank's tokens (the whole row without CP),
    ``seq_lens`` the row's global document lengths. With ``labels`` (this rank's targets, already aligned to
    positions, < 0 to ignore) the output carries per-token log-probs computed without building [T, vocab] logits.
    ``mamba_cp_style`` picks the Mamba-2 CP strategy of every Mamba layer (see the module docstring).

    transformers' Nemotron-H never ties the LM head to the embeddings (whatever ``tie_word_embeddings`` says), and
    neither does this model.
    """

    cp_topology: CPTopology = CPTopology.single()  # set once by set_context_parallel_attributes
    loss_tile_kernels: TileKernels = "auto"  # the loss tiles' passes: Triton kernels on CUDA, else torch

    def __init__(
        self,
        config,
        attention_backend: AttentionBackend = "auto",
        recurrent_backend: RecurrentBackend = "auto",
        mamba_cp_style: MambaCPStyle = "state_passing",
    ):
        super().__init__()
        config = load_nemotron_h_config(config)
        self.config = config
        self.mamba_cp_style = mamba_cp_style
        self.model = NemotronHModel(config, attention_backend, recurrent_backend, mamba_cp_style)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """transformers' initialization: normal(0, initializer_range) for projections, convs, embeddings, the
        router and the experts, zero biases; Mamba A = 1..H, D = 1, dt_bias = softplus^-1 of dt drawn log-uniform in
        [time_step_min, time_step_max] (floored at time_step_floor); Mamba out_proj Kaiming-uniform scaled by
        1/sqrt(layers) when rescale_prenorm_residual."""
        config = self.config
        std = config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding, nn.Conv1d)):
                module.weight.normal_(0.0, std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, NemotronHTopkRouter):
                module.weight.normal_(0.0, std)
                module.e_score_correction_bias.zero_()
            elif isinstance(module, NemotronHExperts):
                module.up_proj.normal_(0.0, std)
                module.down_proj.normal_(0.0, std)
        for module in self.modules():  # after the generic pass, which also visited the mixers' out_proj
            if isinstance(module, NemotronHMamba2Mixer):
                heads = module.num_heads
                module.A_log.copy_(torch.log(torch.arange(1, heads + 1, dtype=torch.float32)))
                module.D.fill_(1.0)
                low, high = math.log(config.time_step_min), math.log(config.time_step_max)
                dt = torch.exp(torch.rand(heads) * (high - low) + low).clamp(min=config.time_step_floor)
                module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
                if config.rescale_prenorm_residual:
                    nn.init.kaiming_uniform_(module.out_proj.weight, a=math.sqrt(5))
                    module.out_proj.weight.div_(math.sqrt(len(config.layers_block_type)))

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
        """Same contract as :class:`cp_models.Qwen35ForCausalLM`. Nemotron-H has no positional encoding (its
        attention has no rotary; order comes from the Mamba layers), so ``position_ids`` are only shape-checked."""
        inputs, device = (input_ids, inputs_embeds, position_ids, labels), self.model.embeddings.weight.device
        tokens, problem = validated_row_inputs(*inputs, vocab_size=self.lm_head.out_features)
        # First: every rank got the same row and no rank's inputs failed, so nothing below raises on one rank alone.
        meta = build_row_metadata(seq_lens, tokens, self.cp_topology, device, inputs=inputs, problem=problem)
        hidden = self.model(embed_row(self.model.embeddings, input_ids, inputs_embeds), meta)
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
        mamba_cp_style: MambaCPStyle = "state_passing",
    ) -> NemotronHForCausalLM:
        """Load a transformers (or original ``backbone.``-prefixed) Nemotron-H checkpoint folder (single or
        sharded safetensors) in ``dtype``, or with None in transformers' ``"auto"`` dtype (the config's, else the
        checkpoint's). Router weights stay fp32 whatever ``dtype`` is, as in transformers."""
        config = load_nemotron_h_config(str(path))
        with torch.device("meta"):
            model = cls(config, attention_backend, recurrent_backend, mamba_cp_style)
        # Expected: the parameters and the routers' correction-bias buffers. Cast before assigning, so that the
        # routers' fp32 tensors never pass through a lower precision.
        to_ours = functools.partial(hf_to_cp_state, config=config)
        config_dtype = getattr(config, "dtype", None)
        load_hf_checkpoint(model, path, to_ours, dtype=dtype, config_dtype=config_dtype, keep_fp32=FP32_ROUTER)
        return model

    def save_pretrained(self, path: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Write a checkpoint folder that transformers' NemotronHForCausalLM loads (its own on-disk layout).

        ``state_dict``: the weights to write instead of this module's own (e.g. gathered from FSDP shards).
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        config = copy.deepcopy(self.config)  # the architectures written are the file's, not this model's config's
        config.architectures = ["NemotronHForCausalLM"]
        state = cp_to_hf_state(unwrapped_names(self.state_dict() if state_dict is None else state_dict), config)
        config.dtype = written_dtype(state)
        config.save_pretrained(path)
        write_safetensors(state, path)


def hf_to_cp_state(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Checkpoint names -> ours: ``backbone.`` -> ``model.``, per-expert weights stacked, MTP weights dropped."""
    state = strip_prefixes(state, [("backbone.", "model.")])
    state = {n: t for n, t in state.items() if not n.startswith("mtp.")}
    experts = config.n_routed_experts
    for layer, kind in enumerate(config.layers_block_type):
        if kind != MOE:
            continue
        prefix = f"model.layers.{layer}.mixer.experts."
        names = [f"{prefix}{e}.{proj}.weight" for e in range(experts) for proj in ("up_proj", "down_proj")]
        missing = [n for n in names if n not in state]
        if len(missing) == len(names):  # stacked (as held in memory) or absent: checked by the caller
            continue
        if missing:
            raise ContextParallelError(f"checkpoint lacks {len(missing)} per-expert tensors, e.g. {missing[:5]}")
        for proj in ("up_proj", "down_proj"):
            state[f"{prefix}{proj}"] = torch.stack([state.pop(f"{prefix}{e}.{proj}.weight") for e in range(experts)])
    return state


def cp_to_hf_state(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Ours -> the layout transformers saves: ``backbone.`` prefix, one tensor per expert."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.startswith("model."):
            name = "backbone." + name[len("model.") :]
        if name.endswith(("mixer.experts.up_proj", "mixer.experts.down_proj")):
            prefix, proj = name.rsplit(".", 1)
            for e, w in enumerate(tensor):
                out[f"{prefix}.{e}.{proj}.weight"] = w
        else:
            out[name] = tensor
    return out
