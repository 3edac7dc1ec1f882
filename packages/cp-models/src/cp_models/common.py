"""Pieces shared by the model files: CP wiring, norms, the tiled loss, the MoE combine, the MLP output, HF
checkpoint I/O."""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from cp_core import (
    AttentionBackend,
    AttentionCPStyle,
    ContextParallelError,
    CPTopology,
    PackedRowMetadata,
    RecurrentBackend,
    build_packed_metadata,
    check_same_row_on_every_rank,
    context_parallel_attention,
    resolve_attention_cp_style,
    resolve_recurrent_backend,
)
from cp_core.packing import check_divisible, normalize_seq_lens


class ContextParallelModule(nn.Module):
    """A layer that mixes tokens and knows how to do it under CP. ``cp_topology`` is set once per model by
    :func:`set_context_parallel_attributes`; per-batch boundaries arrive as forward arguments."""

    cp_topology: CPTopology = CPTopology.single()

    def check_context_parallel(self, cp_size: int) -> None:
        """Raise if this layer cannot run with ``cp_size`` ranks (e.g. a head-count rule)."""


class ContextParallelAttention(ContextParallelModule):
    """Softmax attention under CP, by Ulysses or by all-gathered or ring-passed keys and values
    (``attention_cp_style``, resolved once per model by :func:`set_context_parallel_attributes`). Subclasses set
    ``num_heads``, ``num_kv_heads`` and ``attention_backend`` and call :meth:`attend`."""

    num_heads: int
    num_kv_heads: int
    attention_backend: AttentionBackend = "auto"
    attention_cp_style: str = "ulysses"

    def resolve_attention_cp_style(self, style: str, cp_size: int) -> str:
        return resolve_attention_cp_style(style, self.num_heads, self.num_kv_heads, cp_size)

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        meta: PackedRowMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        return context_parallel_attention(
            query,
            key,
            value,
            meta,
            self.cp_topology,
            self.attention_cp_style,
            scale=scale,
            sliding_window=sliding_window,
            backend=self.attention_backend,
        )


def set_context_parallel_attributes(
    model: nn.Module,
    group: dist.ProcessGroup | None,
    rank: int,
    world_size: int,
    *,
    attention_cp_style: AttentionCPStyle = "ulysses",
) -> CPTopology:
    """Set the CP topology on every token-mixing layer of ``model`` (through activation-checkpoint wrappers).

    ``attention_cp_style`` picks how softmax attention splits: "ulysses" (the default: all-to-all over heads, even
    work; cp must divide the query heads), "kv_gather" (all-gathered keys and values; any cp), "kv_ring" (keys and
    values passed around the ring; any cp, memory that does not grow with the row) or "auto" (Ulysses where its
    head rule holds, else all-gathered KV below ``cp_core.AUTO_RING_FROM_CP`` ranks and the ring from there).

    Validates every layer for ``world_size`` first (head rules), so nothing is half-configured on error. Raises
    :class:`ContextParallelError` for a model containing token-mixing modules that have no CP implementation.
    """
    topology = CPTopology(group=group, rank=rank, size=world_size) if world_size > 1 else CPTopology.single()
    cp_layers = [m for m in model.modules() if isinstance(m, ContextParallelModule)]
    if not cp_layers:
        raise ContextParallelError(
            f"{type(model).__name__} has no context-parallel layers; use a cp_models model (e.g. "
            "cp_models.Qwen35ForCausalLM.from_pretrained) rather than a transformers one"
        )
    for layer in cp_layers:
        layer.check_context_parallel(world_size)
    styles = {
        layer: layer.resolve_attention_cp_style(attention_cp_style, world_size)
        for layer in cp_layers
        if isinstance(layer, ContextParallelAttention)
    }
    for layer in cp_layers:
        layer.cp_topology = topology
    for layer, style in styles.items():
        layer.attention_cp_style = style
    model.cp_topology = topology
    return topology


def build_row_metadata(
    seq_lens: Sequence[int] | torch.Tensor,
    local_len: int,
    topology: CPTopology,
    device: torch.device | str = "cpu",
    *,
    inputs: Sequence[torch.Tensor | None] = (),
    problem: BaseException | None = None,
) -> PackedRowMetadata:
    """Metadata of one packed row whose local shard has ``local_len`` tokens, on ``device``. First checks that every
    CP rank got the same row, with ``inputs`` of the same shapes, and that no rank's own input checks failed
    (``problem``, see :func:`validated_row_inputs`): :func:`cp_core.check_same_row_on_every_rank`, one tiny
    all-reduce on ``device``. So the validation after it raises on every rank alike; call it before anything else
    that can raise."""
    lens: tuple[int, ...] = ()
    if problem is None:
        try:
            lens = normalize_seq_lens(seq_lens)
            check_divisible(sum(lens), topology.size)
        except Exception as exc:  # shards of unequal size (the padding advice, not "other shapes"), or no lengths
            problem = exc
    extra = (local_len, *tensor_shapes(*inputs))
    check_same_row_on_every_rank(seq_lens, topology, device, extra=extra, problem=problem)  # raises any problem
    total = local_len * topology.size
    if sum(lens) != total:  # before any divisibility advice: the lengths and the shard disagree
        raise ContextParallelError(
            f"seq_lens sum to {sum(lens)} tokens but this rank holds {local_len} of a row split over "
            f"cp={topology.size} ({total} tokens): pass the global document lengths and this rank's shard"
        )
    return build_packed_metadata(lens, topology.rank, topology.size, total_len=total).to(device)


def tensor_shapes(*tensors: torch.Tensor | None) -> tuple[int, ...]:
    """The shapes of ``tensors`` as one flat tuple of ints (each: its rank, then its sizes; -1 for None), to compare
    across ranks."""
    out: list[int] = []
    for t in tensors:
        if isinstance(t, torch.Tensor):  # dtype and device type by a stable code (str hashes differ per process)
            out.extend((t.dim(), *t.shape, zlib.crc32(f"{t.dtype} {t.device.type}".encode())))
        else:
            out.append(-1)
    return tuple(out)


def check_token_values(input_ids: torch.Tensor | None, labels: torch.Tensor | None, vocab_size: int | None) -> None:
    """Integer ``input_ids`` in ``[0, vocab_size)`` and integer ``labels`` below it (negative: ignored), read with
    one host sync; raises :class:`ContextParallelError` naming the value."""
    for name, t in (("input_ids", input_ids), ("labels", labels)):
        if t is not None and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
            raise ContextParallelError(f"{name} must hold integer token ids, got dtype {t.dtype}")
    present = [t for t in (input_ids, labels) if t is not None and t.numel()]
    if vocab_size is None or not present:
        return
    bounds = torch.stack([b for t in present for b in (t.min(), t.max())]).tolist()  # one sync
    if input_ids is not None and input_ids.numel():
        low, high = bounds[:2]
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise ContextParallelError(f"input_ids holds token {bad}, outside the vocabulary [0, {vocab_size})")
    if labels is not None and labels.numel() and bounds[-1] >= vocab_size:
        raise ContextParallelError(f"label {bounds[-1]} is outside the vocabulary of {vocab_size}")


def _one_row(name: str, x: torch.Tensor, dims: int) -> torch.Tensor:
    """``x`` with a leading batch dimension of 1 dropped ([1, *row] -> [*row]); raises for any other batch size."""
    if x.dim() == dims + 1:
        if x.size(0) != 1:
            raise ContextParallelError(
                f"{name} has batch size {x.size(0)} (shape {tuple(x.shape)}); a packed row is one sequence "
                "(batch 1): pack the documents into one row and pass their lengths as seq_lens"
            )
        return x[0]
    if x.dim() != dims:
        raise ContextParallelError(f"{name} must have {dims} or {dims + 1} (batch 1) dims, got {tuple(x.shape)}")
    return x


def check_row_inputs(
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    vocab_size: int | None = None,
) -> int:
    """This rank's token count, after checking its inputs: exactly one of ``input_ids`` ([T] or [1, T]) and
    ``inputs_embeds`` ([T, H] or [1, T, H]); ``position_ids`` ending in T ([T], [1, T] or MRoPE [3, T]); ``labels``
    [T] or [1, T], below ``vocab_size`` (negative: ignored)."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ContextParallelError("pass exactly one of input_ids and inputs_embeds")
    if input_ids is not None:
        tokens = _one_row("input_ids", input_ids, 1).size(0)
    else:
        tokens = _one_row("inputs_embeds", inputs_embeds, 2).size(0)
    if position_ids is not None and (
        position_ids.dim() not in (1, 2)
        or position_ids.size(-1) != tokens
        or (position_ids.dim() == 2 and position_ids.size(0) not in (1, 3))
    ):
        raise ContextParallelError(
            f"position_ids {tuple(position_ids.shape)} must be [T], [1, T] or [3, T] with this rank's T = {tokens}"
        )
    if labels is not None:
        labels = _one_row("labels", labels, 1)
        if labels.size(0) != tokens:
            raise ContextParallelError(f"labels {tuple(labels.shape)} must have this rank's {tokens} tokens")
    check_token_values(input_ids, labels, vocab_size)
    return tokens


def validated_row_inputs(*inputs: torch.Tensor | None, vocab_size: int | None = None) -> tuple[int, Exception | None]:
    """:func:`check_row_inputs` without raising: (tokens, None), or (0, what it raised) for
    :func:`build_row_metadata` to raise on every rank alike."""
    try:
        return check_row_inputs(*inputs, vocab_size=vocab_size), None
    except Exception as exc:  # anything a rank's own inputs cause (also a wrong type) must stop every rank
        return 0, exc


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm with weight stored as an offset from 1 (``x / rms(x) * (1 + w)``), computed in fp32.

    On CUDA with flash-linear-attention (``backend`` "auto" or "fla") one fused kernel each way, which keeps only
    ``x`` and the per-row rstd for backward; :meth:`reference` is the torch path everywhere else.
    """

    def __init__(self, dim: int, eps: float = 1e-6, backend: RecurrentBackend = "auto"):
        super().__init__()
        self.eps, self.backend = eps, backend
        self.weight = nn.Parameter(torch.zeros(dim))

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if resolve_recurrent_backend(self.backend, x, "norm") == "fla":
            from fla.modules.norm.layernorm import rms_norm

            return rms_norm(x, 1.0 + self.weight.float(), None, eps=self.eps)
        return self.reference(x)


class GatedRMSNorm(nn.Module):
    """``w * x / rms(x) * silu(z)`` over the last dim (optionally in groups of ``group_size``; with
    ``norm_before_gate=False`` the gate multiplies first, as in Mamba-2).

    On CUDA with flash-linear-attention one fused kernel each way (fla's grouped, gated RMSNorm); :meth:`reference`
    is the torch path everywhere else.
    """

    def __init__(
        self,
        dim: int,
        eps: float = 1e-6,
        group_size: int | None = None,
        norm_before_gate: bool = True,
        backend: RecurrentBackend = "auto",
    ):
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size or dim, norm_before_gate
        self.backend = backend
        self.weight = nn.Parameter(torch.ones(dim))

    def reference(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        y = x.float()
        if not self.norm_before_gate:
            y = y * F.silu(gate.float())
        grouped = y.unflatten(-1, (-1, self.group_size))
        y = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        y = self.weight * y.to(dtype)
        if self.norm_before_gate:
            y = y * F.silu(gate.float())
        return y.to(dtype)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if resolve_recurrent_backend(self.backend, x, "norm") == "fla":
            from fla.modules.norm.layernorm_gated import rmsnorm_fn

            group = None if self.group_size == x.size(-1) else self.group_size
            return rmsnorm_fn(
                x, self.weight, None, z=gate, eps=self.eps, group_size=group, norm_before_gate=self.norm_before_gate
            )
        return self.reference(x, gate)


# ----------------------------------------------------------------------------------------------------------
# Loss without [S, vocab] logits


def _accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 inputs, fp64 for fp64 ones (so an fp64 test runs fp64 through the loss's backward)."""
    return torch.promote_types(x.dtype, torch.float32)


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in at least fp32 (fp64 stays fp64): on CUDA one GEMM with an fp32 output for bf16/fp16 inputs (no
    rounded half-precision product), elsewhere the product in the inputs' dtype, upcast."""
    if a.dtype in (torch.bfloat16, torch.float16) and a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError):  # torch without mixed-dtype mm
            pass
    return (a @ b).to(_accumulation_dtype(a))


def _label_columns(labels: torch.Tensor, vocab: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's label as a column of the vocabulary tile ``vocab`` (clamped into it) and whether it falls there."""
    local = labels - vocab.start
    hit = (local >= 0) & (local < vocab.stop - vocab.start)
    return local.clamp(0, vocab.stop - vocab.start - 1)[:, None], hit


class _TiledTokenLogProbs(torch.autograd.Function):
    """log p(label | hidden) per token over [token chunk, vocabulary chunk] tiles, forward and backward.

    Forward keeps one fp32 tile at a time and a running log-sum-exp per token, and saves that log-sum-exp ([T]
    fp32), so backward rebuilds each tile's probabilities as ``exp(logits - lse)`` without a second pass over the
    vocabulary. With ``g`` the per-token upstream gradient, ``d logits = -g (softmax - onehot)``: ``g`` goes onto
    the small [chunk, hidden] sides of the two matmuls, never onto a tile. The gradient of the side the outer loop
    runs over accumulates per chunk in fp32; the other side's fp32 accumulator is full size, so the outer loop runs
    over the vocabulary when the shard has fewer tokens than the vocabulary (accumulator [T, hidden]) and over the
    tokens otherwise ([vocab, hidden]). Tiles are fp32 (on CUDA straight out of the GEMM); the matmuls of backward
    take the weight's dtype, as a plain cross-entropy over bf16 logits would. fp64 inputs run in fp64 throughout
    (tiles, log-sum-exp, accumulators), forward and backward.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, token_chunk, vocab_chunk):
        num_tokens, vocab = hidden.size(0), weight.size(0)
        acc = _accumulation_dtype(hidden)
        lse = hidden.new_full((num_tokens,), float("-inf"), dtype=acc)
        target = hidden.new_zeros(num_tokens, dtype=acc)
        for t, v in ((t, v) for t in _chunks(num_tokens, token_chunk) for v in _chunks(vocab, vocab_chunk)):
            logits = _mm_f32(hidden[t], weight[v].t())
            column, hit = _label_columns(labels[t], v)
            target[t] = torch.where(hit, logits.gather(1, column).squeeze(1), target[t])
            row_max = logits.amax(-1)
            tile_lse = logits.sub_(row_max[:, None]).exp_().sum(-1).log_().add_(row_max)
            lse[t] = torch.logaddexp(lse[t], tile_lse)
            del logits
        ctx.tiles = (token_chunk, vocab_chunk)
        ctx.save_for_backward(hidden, weight, labels, lse)
        return target - lse

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, labels, lse = ctx.saved_tensors
        (num_tokens, width), vocab = hidden.shape, weight.size(0)
        token_chunk, vocab_chunk = ctx.tiles
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        # Without a weight gradient (a frozen LM head, e.g. LoRA) the token-outer order needs no full accumulator.
        token_outer = num_tokens > vocab or not need_weight
        acc = _accumulation_dtype(hidden)
        neg_grad = -grad_out.to(acc)[:, None]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.empty_like(weight) if need_weight else None
        full_rows = (vocab if need_weight else 0) if token_outer else (num_tokens if need_hidden else 0)
        full = hidden.new_zeros((full_rows, width), dtype=acc) if full_rows else None
        outer = _chunks(num_tokens, token_chunk) if token_outer else _chunks(vocab, vocab_chunk)
        inner = _chunks(vocab, vocab_chunk) if token_outer else _chunks(num_tokens, token_chunk)
        for o in outer:
            partial = hidden.new_zeros((o.stop - o.start, width), dtype=acc)
            for i in inner:
                t, v = (o, i) if token_outer else (i, o)
                probs = _mm_f32(hidden[t], weight[v].t()).sub_(lse[t, None]).exp_()
                column, hit = _label_columns(labels[t], v)
                probs.scatter_add_(1, column, -hit.to(probs.dtype)[:, None])  # softmax - onehot
                probs = probs.to(weight.dtype)
                if need_hidden:
                    (partial if token_outer else full[t]).add_(_mm_f32(probs, weight[v]))
                if need_weight:
                    scaled_hidden = (hidden[t].to(acc) * neg_grad[t]).to(weight.dtype)
                    (full[v] if token_outer else partial).add_(_mm_f32(probs.t(), scaled_hidden))
                del probs
            if token_outer and need_hidden:
                grad_hidden[o] = (partial * neg_grad[o]).to(hidden.dtype)
            elif not token_outer and need_weight:
                grad_weight[o] = partial.to(weight.dtype)
        if token_outer and need_weight:
            grad_weight.copy_(full)
        elif not token_outer and need_hidden:
            grad_hidden.copy_(full.mul_(neg_grad))
        return grad_hidden, grad_weight, None, None, None


def _chunks(total: int, size: int) -> list[slice]:
    return [slice(start, min(start + size, total)) for start in range(0, total, size)]


LOSS_TILE = (4096, 8192)
"""Default tile of the loss: [tokens, vocabulary entries] (128 MiB of fp32 logits)."""


def loss_tile_shape(
    num_tokens: int, vocab_size: int, token_chunk: int | None = None, vocab_chunk: int | None = None
) -> tuple[int, int]:
    """The tile the loss runs: the given or default sizes, clipped to the shard and the vocabulary."""
    return (
        max(1, min(token_chunk or LOSS_TILE[0], num_tokens)),
        max(1, min(vocab_chunk or LOSS_TILE[1], vocab_size)),
    )


def token_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    *,
    check_labels: bool = True,
) -> torch.Tensor:
    """Per-token ``log softmax(hidden @ weight.T)[label]`` in fp32 (fp64 for fp64 inputs) ([T]); never builds
    [T, vocab] logits.

    Labels < 0 (ignored tokens) give 0 and no gradient; combine with a loss mask by multiplication. The logits are
    computed in tiles of ``chunk_size`` tokens x ``vocab_chunk_size`` vocabulary entries (default
    :data:`LOSS_TILE`), so the workspace is one tile plus an fp32 gradient accumulator of ``min(T, vocab)`` rows.
    ``check_labels=False`` skips reading the largest label (a host sync) where the caller has checked them.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ContextParallelError(
            f"hidden must be [T, H], weight [vocab, H] and labels [T]; got {tuple(hidden.shape)}, "
            f"{tuple(weight.shape)} and {tuple(labels.shape)}"
        )
    if hidden.size(1) != weight.size(1):
        raise ContextParallelError(f"hidden width {hidden.size(1)} != the LM head's {weight.size(1)}")
    for name, size in (("chunk_size", chunk_size), ("vocab_chunk_size", vocab_chunk_size)):
        if size is not None and (not isinstance(size, int) or size < 1):
            raise ContextParallelError(f"{name} must be a positive number of rows, got {size!r}")
    if check_labels:
        check_token_values(None, labels, weight.size(0))
    tile = loss_tile_shape(hidden.size(0), weight.size(0), chunk_size, vocab_chunk_size)
    valid = labels >= 0
    return _TiledTokenLogProbs.apply(hidden, weight, labels.clamp_min(0), *tile) * valid


# ----------------------------------------------------------------------------------------------------------
# MoE: combine the top-k expert outputs of each token


class _WeightedSlotSum(torch.autograd.Function):
    """``out[t] = sum_j weights[t, j] * slots[t, j]`` in the promoted dtype of the two, returned in ``out_dtype``.

    Saves only ``slots`` (in their own dtype) and ``weights``: autograd on ``(slots * weights).sum`` or on an
    ``index_add_`` of weighted outputs keeps a weighted copy too (index_add_ saves its source), and on bf16 slots
    with fp32 weights an fp32 copy of the slots. Deterministic (no atomics), unlike ``index_add_`` on CUDA.
    """

    @staticmethod
    def forward(ctx, slots, weights, out_dtype):
        compute = torch.promote_types(slots.dtype, weights.dtype)
        ctx.save_for_backward(slots, weights)
        return torch.bmm(weights.to(compute)[:, None, :], slots.to(compute)).squeeze(1).to(out_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        slots, weights = ctx.saved_tensors
        compute = torch.promote_types(slots.dtype, weights.dtype)
        grad = grad_out.to(compute)
        grad_slots = torch.bmm(weights.to(compute)[:, :, None], grad[:, None, :]).to(slots.dtype)
        grad_weights = torch.bmm(slots.to(compute), grad[:, :, None]).squeeze(-1).to(weights.dtype)
        return grad_slots, grad_weights, None


def combine_expert_outputs(
    sorted_outputs: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """Each token's routing-weighted sum of its top-k expert outputs ([T, D] in ``out_dtype``).

    ``sorted_outputs`` [T * k, D] are the expert outputs in expert-sorted slot order, ``order`` the permutation that
    sorted the flat [T * k] slots (``experts.reshape(-1).argsort()``), ``weights`` [T, k] the routing weights.
    The sum is accumulated in the promoted dtype of outputs and weights (fp32 weights: fp32, as transformers'
    Nemotron-H does). Keeps one [T * k, D] tensor for backward (the outputs back in token order).
    """
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    slots = sorted_outputs[inverse].view(*weights.shape, -1)
    return _WeightedSlotSum.apply(slots, weights, out_dtype)


# ----------------------------------------------------------------------------------------------------------
# MLP output: the activation recomputed in backward instead of kept


def _linear_weight_grads(grad_out: torch.Tensor, act: torch.Tensor, ctx, weight_index: int):
    """``down_proj``'s weight and bias gradients from its output gradient and (recomputed) input ``act``."""
    flat_grad = grad_out.reshape(-1, grad_out.size(-1))
    grad_weight = flat_grad.t().mm(act.reshape(-1, act.size(-1))) if ctx.needs_input_grad[weight_index] else None
    grad_bias = flat_grad.sum(0) if ctx.needs_input_grad[weight_index + 1] else None
    return grad_weight, grad_bias


class _SwiGLULinear(torch.autograd.Function):
    """``F.linear(silu(gate) * up, weight, bias)`` keeping only ``gate`` and ``up`` for backward.

    Autograd on the plain expression keeps four [T, intermediate] tensors (gate, silu(gate), up, the product);
    silu(gate) and the product are recomputed here, one elementwise pass. The backward runs the same ops autograd
    would (mul, silu_backward, the two matmuls), so the gradients are autograd's; its extra live tensors peak at
    three [T, intermediate] buffers.
    """

    @staticmethod
    def forward(ctx, gate, up, weight, bias):
        ctx.save_for_backward(gate, up, weight)
        return F.linear(F.silu(gate) * up, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        gate, up, weight = ctx.saved_tensors
        silu = F.silu(gate)
        grad_weight, grad_bias = _linear_weight_grads(grad_out, silu * up, ctx, 2)
        grad_act = grad_out.matmul(weight)
        grad_up = grad_act * silu if ctx.needs_input_grad[1] else None
        del silu
        grad_gate = torch.ops.aten.silu_backward(grad_act.mul_(up), gate) if ctx.needs_input_grad[0] else None
        return grad_gate, grad_up, grad_weight, grad_bias


class _SquaredReLULinear(torch.autograd.Function):
    """``F.linear(relu(x)^2, weight, bias)`` keeping only ``x`` (autograd keeps relu(x) and its square)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return F.linear(F.relu(x).square(), weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        relu = F.relu(x)
        grad_weight, grad_bias = _linear_weight_grads(grad_out, relu.square(), ctx, 1)
        grad_x = None
        if ctx.needs_input_grad[0]:  # pow's backward (grad * 2 relu), then relu's (zero where relu(x) <= 0)
            grad_x = torch.ops.aten.threshold_backward(grad_out.matmul(weight).mul_(relu * 2), relu, 0)
        return grad_x, grad_weight, grad_bias


def _recompute_applies(x: torch.Tensor, module: nn.Module) -> bool:
    """Whether the recomputing Functions apply: autograd is recording; ``module`` is a bare ``nn.Linear`` (not a
    LoRA wrapper or any subclass whose forward does more) without forward hooks of its own (the Functions read its
    weight and never call it; global hooks, which observers such as module trackers register, do not switch the
    path, so what they observe is what runs without them); autocast is off (its casts live in the graph of the
    plain expression, and the Functions' backward would meet the uncast weight)."""
    if not torch.is_grad_enabled() or type(module) is not nn.Linear:
        return False
    if module._forward_hooks or module._forward_pre_hooks:
        return False
    return x.device.type == "meta" or not torch.is_autocast_enabled(x.device.type)


def swiglu_linear(gate: torch.Tensor, up: torch.Tensor, down_proj: nn.Module) -> torch.Tensor:
    """``down_proj(silu(gate) * up)``, recomputing silu(gate) and the product in backward: 2 instead of 4
    [T, intermediate] tensors kept. Any ``down_proj`` other than a plain ``nn.Linear`` (a LoRA adapter), and
    autocast, get the plain expression."""
    if _recompute_applies(gate, down_proj):
        return _SwiGLULinear.apply(gate, up, down_proj.weight, down_proj.bias)
    return down_proj(F.silu(gate) * up)


def squared_relu_linear(x: torch.Tensor, down_proj: nn.Module) -> torch.Tensor:
    """``down_proj(relu(x)^2)``, recomputing relu(x)^2 in backward: 1 instead of 2 [T, intermediate] tensors
    kept. A ``down_proj`` other than a plain ``nn.Linear``, and autocast, get the plain expression."""
    if _recompute_applies(x, down_proj):
        return _SquaredReLULinear.apply(x, down_proj.weight, down_proj.bias)
    return down_proj(F.relu(x).square())


# ----------------------------------------------------------------------------------------------------------
# HF checkpoint I/O


def read_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a HF checkpoint folder (single file or sharded with an index)."""
    from safetensors.torch import load_file

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(str(path / name)))
    return state


def write_safetensors(
    state: Mapping[str, torch.Tensor], path: str | os.PathLike, max_shard_bytes: int = 5 * 2**30
) -> None:
    """Write ``state`` as HF safetensors (sharded with an index above ``max_shard_bytes``)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.detach().contiguous().cpu()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in state.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )


def check_checkpoint_keys(state: Mapping[str, torch.Tensor], expected: Iterable[str], path: str | os.PathLike) -> None:
    """Raise naming a few examples when a checkpoint lacks expected tensors or has unknown ones."""
    expected = set(expected)
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing:
        raise ContextParallelError(f"checkpoint {path} lacks {len(missing)} tensors, e.g. {sorted(missing)[:5]}")
    if unexpected:
        raise ContextParallelError(f"checkpoint {path} has unknown tensors, e.g. {sorted(unexpected)[:5]}")


@dataclass
class CausalLMOutput:
    hidden_states: torch.Tensor
    """Final normed hidden states of this rank's tokens, [T, H]."""
    logits: torch.Tensor | None = None
    """[T, vocab], only when asked for (``return_logits=True``)."""
    token_log_probs: torch.Tensor | None = None
    """log p(label) per token (fp32, 0 where label < 0), when labels are given."""


def embed_row(
    embed_tokens: nn.Embedding, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None
) -> torch.Tensor:
    """This rank's embeddings [T, H] from ``input_ids`` ([T] or [1, T]) or ``inputs_embeds`` ([T, H] or [1, T, H])
    (checked by :func:`check_row_inputs`)."""
    if input_ids is None:
        return _one_row("inputs_embeds", inputs_embeds, 2)
    return embed_tokens(_one_row("input_ids", input_ids, 1))


def row_position_ids(position_ids: torch.Tensor | None, meta: PackedRowMetadata) -> torch.Tensor:
    """``position_ids`` as [T] or [3, T] (a [1, T] batch dimension dropped), or the row's own positions when None."""
    if position_ids is None:
        return meta.local_position_ids
    return position_ids[0] if position_ids.dim() == 2 and position_ids.size(0) == 1 else position_ids


def causal_lm_output(
    hidden: torch.Tensor,
    lm_head: nn.Linear,
    labels: torch.Tensor | None,
    return_logits: bool | None,
    loss_chunk_size: int | None,
) -> CausalLMOutput:
    """The output of a causal LM's forward: per-token log-probs when ``labels`` are given (tiles of
    :data:`LOSS_TILE` logits; ``loss_chunk_size`` tokens per tile if given), logits when asked for (by default only
    without labels)."""
    out = CausalLMOutput(hidden_states=hidden)
    if labels is not None:
        labels = _one_row("labels", labels, 1)  # checked against the vocabulary by the models before any collective
        out.token_log_probs = token_log_probs(hidden, lm_head.weight, labels, loss_chunk_size, check_labels=False)
    if return_logits or (return_logits is None and labels is None):
        out.logits = lm_head(hidden)
    return out


def unwrapped_names(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with the name parts that activation-checkpoint and compile wrappers add removed (HF names)."""
    return {k.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""): v for k, v in state.items()}


def strip_prefixes(state: Mapping[str, torch.Tensor], prefixes: Iterable[tuple[str, str]]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state.items():
        for old, new in prefixes:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        out[name] = tensor
    return out


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of decoder blocks: ``model.decoder_layers()`` for cp_models' models (the VL model's are its
    language model's), else ``model.model.layers``."""
    layers = (
        model.decoder_layers()
        if hasattr(model, "decoder_layers")
        else getattr(getattr(model, "model", None), "layers", None)
    )
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no ModuleList of decoder blocks (model.decoder_layers())")
    return layers


def apply_activation_checkpointing(model: nn.Module, layers: nn.ModuleList | None = None) -> nn.Module:
    """Wrap every decoder layer in torch's non-reentrant checkpoint wrapper (activations recomputed in backward).

    Works before or after :func:`set_context_parallel_attributes`: CP wiring looks through the wrappers.
    Collectives inside a layer are re-issued during recomputation, identically on every rank.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    layers = layers if layers is not None else decoder_layers(model)
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    return model
