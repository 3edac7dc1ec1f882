"""Memory per rank: weights, gradients, optimizer state, activations, workspace, headroom; the longest row."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sft_trainer.plan.activations import activation_bytes_per_token, loss_workspace_bytes
from sft_trainer.plan.coefficients import DTYPE_BYTES, FSDP_GATHERED_BLOCKS, FSDP_GRADIENT_BLOCKS, GIB, HEADROOM
from sft_trainer.plan.parameters import _family, count_parameters, layer_kinds


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
