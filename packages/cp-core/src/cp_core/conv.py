"""Causal depthwise conv1d over packed documents, with exact context parallelism (halo exchange).

``y_t = act(bias + sum_{s=0}^{W-1} weight[:, W-1-s] * x_{t-s})`` where ``x_{t-s}`` counts only if it belongs to
the same document as ``x_t`` (the conv restarts at every document start). ``x`` is [T, D] (tokens first),
``weight`` [D, W] (``weight[:, W-1]`` multiplies the current token: ``nn.Conv1d.weight[:, 0, :]``).

Under CP a rank needs the previous rank's last ``W-1`` inputs, but only those of its own first document: a
neighbour send/recv (no all-gather) brings them, the per-token positions mask the ones from other documents, and
backward returns their gradient to the previous rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from cp_core.document_bounds import DocumentBounds, build_document_bounds
from cp_core.errors import ContextParallelError
from cp_core.packing import PackedRowMetadata, position_ids_from_seq_lens
from cp_core.recurrent_backends import RecurrentBackend, resolve_recurrent_backend
from cp_core.sharding import exchange_p2p
from cp_core.topology import CPTopology

ACTIVATIONS = (None, "silu")


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None) -> None:
    if x.dim() != 2 or weight.dim() != 2 or weight.size(0) != x.size(1):
        raise ContextParallelError(
            f"expected x [T, D] and weight [D, W]; got x {tuple(x.shape)} and weight {tuple(weight.shape)}"
        )
    if bias is not None and bias.shape != (x.size(1),):
        raise ContextParallelError(f"bias must be [D] = [{x.size(1)}], got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ContextParallelError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def _check_lens(x: torch.Tensor, seq_lens: Sequence[int]) -> None:
    if sum(seq_lens) != x.size(0):
        raise ContextParallelError(
            f"document lengths {list(seq_lens)} sum to {sum(seq_lens)}, but x has {x.size(0)} tokens"
        )


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    return F.silu(y) if activation == "silu" else y


def naive_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    *,
    seq_lens: Sequence[int],
) -> torch.Tensor:
    """Reference: ``F.conv1d`` with left padding on each document separately."""
    _check(x, weight, bias, activation)
    _check_lens(x, seq_lens)
    width, outputs = weight.size(1), []
    for doc in x.split(list(seq_lens)):
        y = F.conv1d(doc.t().unsqueeze(0), weight.unsqueeze(1), bias, padding=width - 1, groups=x.size(1))
        outputs.append(y[0, :, : doc.size(0)].t())
    return _activate(torch.cat(outputs), activation)


def causal_conv1d_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    positions: torch.Tensor,
    halo: torch.Tensor | None = None,
) -> torch.Tensor:
    """Shift-and-add conv; ``positions`` [T] is each token's index inside its document (masks other documents),
    ``halo`` [W-1, D] the inputs just before ``x`` (read only where positions reach back into them)."""
    width = weight.size(1)
    extended = x if halo is None else torch.cat([halo.to(x.dtype), x])
    offset = 0 if halo is None else width - 1
    positions = positions.to(x.device)
    y = x * weight[:, width - 1]
    for shift in range(1, width):
        start = offset - shift
        if start < 0:  # no halo: the first `shift` tokens have nothing that far back
            shifted = F.pad(extended[: x.size(0) + start], (0, 0, -start, 0))
        else:
            shifted = extended[start : start + x.size(0)]
        y = y + shifted * (positions >= shift).to(x.dtype)[:, None] * weight[:, width - 1 - shift]
    if bias is not None:
        y = y + bias
    return _activate(y, activation)


def _fla_causal_conv1d(
    x, weight, bias, activation, seq_lens, halo, tokens_before, bounds: DocumentBounds | None = None
):
    from fla.modules.causal_conv1d import causal_conv1d

    bounds = bounds if bounds is not None else build_document_bounds(seq_lens, x.device)

    width = weight.size(1)
    initial = None
    if halo is not None:
        # fla's state is [docs, D, W]; slot W-j holds x_{-j}. Only the first document's own tokens may enter.
        keep = torch.arange(width - 1, device=x.device) >= (width - 1 - tokens_before)
        first = torch.cat([halo.new_zeros(1, x.size(1)), halo * keep[:, None].to(halo.dtype)]).t()
        initial = torch.cat([first[None], first.new_zeros(len(seq_lens) - 1, *first.shape)])
    y, _ = causal_conv1d(
        x.unsqueeze(0),
        weight=weight,
        bias=bias,
        activation=activation,
        initial_state=initial,
        **bounds.fla_kwargs(),
    )
    return y.squeeze(0)


def _mamba_causal_conv1d(
    x, weight, bias, activation, seq_lens, halo, tokens_before, bounds: DocumentBounds | None = None
):
    """causal-conv1d's CUDA kernel, channel-last (the layout its ``seq_idx`` and ``initial_states`` need)."""
    from causal_conv1d import causal_conv1d_fn

    bounds = bounds if bounds is not None else build_document_bounds(seq_lens, x.device)

    width, dim = weight.size(1), x.size(1)
    if not 2 <= width <= 4 or dim % 8:
        raise ContextParallelError(
            f"causal-conv1d runs widths 2-4 on channels divisible by 8, got width {width} and {dim} channels; "
            "use recurrent_backend 'fla' or 'torch'"
        )
    initial = None
    if halo is not None:  # only the first document's own earlier tokens may enter: zero the rest of the halo
        keep = torch.arange(width - 1, device=x.device) >= (width - 1 - tokens_before)
        initial = (halo.to(x.dtype) * keep[:, None].to(x.dtype)).t()[None]  # [1, D, W-1], channel-last
    y = causal_conv1d_fn(
        x.t()[None],  # [1, D, T] with stride 1 along D: channel-last
        weight.to(x.dtype),
        bias.to(x.dtype) if bias is not None else None,
        seq_idx=bounds.seq_idx,
        initial_states=initial,
        activation=activation,
    )
    return y[0].t()


def _kernel_conv(kernel, x, weight, bias, activation, seq_lens, halo, tokens_before, positions, bounds=None):
    """The conv on ``kernel``; ``bounds`` (the documents' kernel boundaries on x's device) are built when not
    given."""
    if kernel == "torch":
        return causal_conv1d_torch(x, weight, bias, activation, positions, halo)
    run = _fla_causal_conv1d if kernel == "fla" else _mamba_causal_conv1d
    return run(x, weight, bias, activation, seq_lens, halo, tokens_before, bounds)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    *,
    seq_lens: Sequence[int],
    backend: RecurrentBackend = "auto",
    bounds: DocumentBounds | None = None,
) -> torch.Tensor:
    """Causal depthwise conv over local documents ``seq_lens`` (no CP). ``bounds``: their kernel boundaries on x's
    device, when the caller holds them (a layer: its row's :class:`~cp_core.document_bounds.RowBounds`)."""
    _check(x, weight, bias, activation)
    _check_lens(x, seq_lens)
    kernel = resolve_recurrent_backend(backend, x, "conv")
    positions = position_ids_from_seq_lens(seq_lens) if kernel == "torch" else None
    return _kernel_conv(kernel, x, weight, bias, activation, seq_lens, None, 0, positions, bounds)


def _needs_halo(metadata: PackedRowMetadata, rank: int) -> bool:
    return 0 < rank < metadata.cp_size and metadata.doc_start_rank_by_rank[rank] < rank


class _Halo(torch.autograd.Function):
    """The previous rank's last ``W-1`` rows (zeros where no halo is needed); backward sends their gradient back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, halo_len: int, metadata: PackedRowMetadata, topology: CPTopology):
        rank = topology.rank
        ctx.send_grad_to = rank - 1 if _needs_halo(metadata, rank) else None
        ctx.recv_grad_from = rank + 1 if _needs_halo(metadata, rank + 1) else None
        ctx.halo_len, ctx.topology, ctx.x_shape = halo_len, topology, x.shape
        halo = exchange_p2p(x[-halo_len:], (halo_len, x.size(1)), ctx.recv_grad_from, ctx.send_grad_to, topology)
        return halo if halo is not None else x.new_zeros(halo_len, x.size(1))

    @staticmethod
    def backward(ctx, grad_halo: torch.Tensor):
        shape = (ctx.halo_len, grad_halo.size(1))
        tail = exchange_p2p(grad_halo, shape, ctx.send_grad_to, ctx.recv_grad_from, ctx.topology)
        grad_x = grad_halo.new_zeros(ctx.x_shape)
        if tail is not None:
            grad_x[-ctx.halo_len :] = tail
        return grad_x, None, None, None


def exchange_halo(x: torch.Tensor, halo_len: int, metadata: PackedRowMetadata, topology: CPTopology) -> torch.Tensor:
    """[halo_len, D]: the ``halo_len`` inputs before this shard (zeros on ranks whose first document starts here)."""
    if metadata.local_len < halo_len:
        raise ContextParallelError(
            f"each CP shard must hold at least W-1={halo_len} tokens for the conv halo, but shards have "
            f"{metadata.local_len} (row {metadata.total_len}, cp={metadata.cp_size}); use a smaller cp or longer rows"
        )
    return _Halo.apply(x, halo_len, metadata, topology)


def causal_conv1d_cp(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    metadata: PackedRowMetadata,
    topology: CPTopology,
    *,
    activation: str | None = None,
    backend: RecurrentBackend = "auto",
) -> torch.Tensor:
    """This rank's causal conv output over a packed row sharded over ``topology`` (exact vs the unsharded run).

    Communication: ``W-1`` rows of ``x`` to the next rank forward, their gradient back in backward, only between
    ranks that share a document.
    """
    _check(x, weight, bias, activation)
    if x.size(0) != metadata.local_len:
        raise ContextParallelError(
            f"x holds {x.size(0)} tokens but this shard has {metadata.local_len} (rank {metadata.cp_rank} "
            f"of cp={metadata.cp_size})"
        )
    width = weight.size(1)
    halo = exchange_halo(x, width - 1, metadata, topology) if topology.enabled and width > 1 else None
    kernel = resolve_recurrent_backend(backend, x, "conv")
    bounds = None if kernel == "torch" else metadata.kernel_bounds(x.device).local
    return _kernel_conv(
        kernel,
        x,
        weight,
        bias,
        activation,
        metadata.local_seq_lens,
        halo,
        metadata.first_doc_tokens_before,
        metadata.local_position_ids,
        bounds,
    )
