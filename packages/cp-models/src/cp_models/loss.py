"""The causal LM's loss without [T, vocab] logits: per-token log-probs over tiles of the LM head, and the model
output that carries them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from cp_core import ContextParallelError
from cp_models.loss_tiles import (
    TileKernels,
    resolve_tile_kernels,
    tile_grad_torch,
    tile_grad_triton,
    tile_stats_torch,
    tile_stats_triton,
)
from cp_models.row_inputs import check_token_values, one_row


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


def _label_tiles(labels: torch.Tensor, vocab_tiles: list[slice]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each label as a column of every vocabulary tile ([tiles, T], clamped into the tile) and the tile it falls in
    ([T]): computed once per call, so the tile loops index them instead of launching the comparisons per tile."""
    size, vocab = vocab_tiles[0].stop, vocab_tiles[-1].stop
    starts = torch.arange(0, vocab, size, device=labels.device)  # on the device: no host copy, no sync
    last = (vocab - starts).clamp_(max=size) - 1
    columns = (labels[None, :] - starts[:, None]).clamp_(min=0)
    return torch.minimum(columns, last[:, None]), labels // size


class _TiledTokenLogProbs(torch.autograd.Function):
    """log p(label | hidden) per token over [token chunk, vocabulary chunk] tiles, forward and backward.

    Forward keeps one fp32 tile at a time and each tile's row max, sum of exponentials and label logit per token
    ([tiles, T] fp32, written in place), combined into the log-sum-exp after the loop; it saves that log-sum-exp
    ([T] fp32), so backward rebuilds each tile's probabilities as ``exp(logits - lse)`` without a second pass over
    the vocabulary. With ``g`` the per-token upstream gradient, ``d logits = -g (softmax - onehot)``: ``g`` goes onto
    the small [chunk, hidden] sides of the two matmuls, never onto a tile. The gradient of the side the outer loop
    runs over accumulates per chunk in fp32; the other side's fp32 accumulator is full size, so the outer loop runs
    over the vocabulary when the shard has fewer tokens than the vocabulary (accumulator [T, hidden]) and over the
    tokens otherwise ([vocab, hidden]). Tiles are fp32 (on CUDA straight out of the GEMM); the matmuls of backward
    take the weight's dtype, as a plain cross-entropy over bf16 logits would. fp64 inputs run in fp64 throughout
    (tiles, log-sum-exp, accumulators), forward and backward. Each tile costs a handful of launches (the label
    bookkeeping is per call), which keeps the host ahead of the GPU at short rows.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, token_chunk, vocab_chunk, kernels):
        num_tokens, vocab = hidden.size(0), weight.size(0)
        acc = _accumulation_dtype(hidden)
        vocab_tiles = _chunks(vocab, vocab_chunk)
        columns, label_tile = _label_tiles(labels, vocab_tiles)
        row_max, exp_sum, label_logit = hidden.new_empty((3, len(vocab_tiles), num_tokens), dtype=acc)
        tile_stats = tile_stats_triton if kernels == "triton" else tile_stats_torch
        for t in _chunks(num_tokens, token_chunk):
            for j, v in enumerate(vocab_tiles):
                logits = _mm_f32(hidden[t], weight[v].t())
                tile_stats(logits, columns[j, t], row_max[j, t], exp_sum[j, t], label_logit[j, t])
                del logits
        lse = exp_sum.log_().add_(row_max).logsumexp(0)
        target = label_logit.gather(0, label_tile[None]).squeeze(0)
        ctx.tiles, ctx.kernels = (token_chunk, vocab_chunk), kernels
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
        vocab_tiles = _chunks(vocab, vocab_chunk)
        columns, label_tile = _label_tiles(labels, vocab_tiles)
        # -1 at each token's label column in its own tile, 0 in the others: the "- onehot" of softmax - onehot.
        minus_onehot = -(label_tile[None] == torch.arange(len(vocab_tiles), device=labels.device)[:, None]).to(acc)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.empty_like(weight) if need_weight else None
        full_rows = (vocab if need_weight else 0) if token_outer else (num_tokens if need_hidden else 0)
        full = hidden.new_zeros((full_rows, width), dtype=acc) if full_rows else None
        tile_grad = tile_grad_triton if ctx.kernels == "triton" else tile_grad_torch  # softmax - onehot
        token_tiles = list(enumerate(_chunks(num_tokens, token_chunk)))
        vocab_indexed = list(enumerate(vocab_tiles))
        outer, inner = (token_tiles, vocab_indexed) if token_outer else (vocab_indexed, token_tiles)
        for o_index, o in outer:
            partial = hidden.new_zeros((o.stop - o.start, width), dtype=acc)
            for i_index, i in inner:
                (t, v), j = ((o, i), i_index) if token_outer else ((i, o), o_index)
                probs = tile_grad(
                    _mm_f32(hidden[t], weight[v].t()), lse[t], columns[j, t], minus_onehot[j, t], weight.dtype
                )
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
        return grad_hidden, grad_weight, None, None, None, None


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
    tile_kernels: TileKernels = "auto",
) -> torch.Tensor:
    """Per-token ``log softmax(hidden @ weight.T)[label]`` in fp32 (fp64 for fp64 inputs) ([T]); never builds
    [T, vocab] logits.

    Labels < 0 (ignored tokens) give 0 and no gradient; combine with a loss mask by multiplication. The logits are
    computed in tiles of ``chunk_size`` tokens x ``vocab_chunk_size`` vocabulary entries (default
    :data:`LOSS_TILE`), so the workspace is one tile plus an fp32 gradient accumulator of ``min(T, vocab)`` rows.
    ``check_labels=False`` skips reading the largest label (a host sync) where the caller has checked them.
    ``tile_kernels="triton"`` runs each tile's two elementwise passes as one Triton kernel each
    (:mod:`cp_models.loss_tiles`; CUDA, fp32 tiles) instead of torch's ops; ``"auto"`` does where it can run.
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
    kernels = resolve_tile_kernels(tile_kernels, hidden)
    if check_labels:
        check_token_values(None, labels, weight.size(0))
    tile = loss_tile_shape(hidden.size(0), weight.size(0), chunk_size, vocab_chunk_size)
    valid = labels >= 0
    return _TiledTokenLogProbs.apply(hidden, weight, labels.clamp_min(0), *tile, kernels) * valid


@dataclass
class CausalLMOutput:
    hidden_states: torch.Tensor
    """Final normed hidden states of this rank's tokens, [T, H]."""
    logits: torch.Tensor | None = None
    """[T, vocab], only when asked for (``return_logits=True``)."""
    token_log_probs: torch.Tensor | None = None
    """log p(label) per token (fp32, 0 where label < 0), when labels are given."""


def causal_lm_output(
    hidden: torch.Tensor,
    lm_head: nn.Linear,
    labels: torch.Tensor | None,
    return_logits: bool | None,
    loss_chunk_size: int | None,
    tile_kernels: TileKernels = "auto",
) -> CausalLMOutput:
    """The output of a causal LM's forward: per-token log-probs when ``labels`` are given (tiles of
    :data:`LOSS_TILE` logits; ``loss_chunk_size`` tokens per tile if given; the tiles' passes on ``tile_kernels``),
    logits when asked for (by default only without labels)."""
    out = CausalLMOutput(hidden_states=hidden)
    if labels is not None:
        labels = one_row("labels", labels, 1)  # checked against the vocabulary by the models before any collective
        out.token_log_probs = token_log_probs(
            hidden, lm_head.weight, labels, loss_chunk_size, check_labels=False, tile_kernels=tile_kernels
        )
    if return_logits or (return_logits is None and labels is None):
        out.logits = lm_head(hidden)
    return out
