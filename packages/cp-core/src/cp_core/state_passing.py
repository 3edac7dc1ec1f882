"""Exact CP for linear recurrences by passing states between neighbouring ranks.

A recurrence whose state evolves as ``S_t = T_t(S_{t-1}) + (input term)`` with ``T_t`` linear is, over a stretch
of tokens, ``S_end = M S_start + S_ext``: ``M`` is the product of the stretch's transitions and ``S_ext`` what the
stretch accumulates from a zero state. Each rank computes ``(S_ext, M)`` for its last document's local stretch.
The state then travels down the chain of ranks that share a document:

    rank r receives S0_r from rank r-1 (when its first document began earlier),
    and sends  S0_{r+1} = S_ext_r + (M_r S0_r  if that same document continues, else 0)  to rank r+1.

Backward runs the chain in reverse: rank r receives dL/dS0_{r+1} (the total, later ranks included) from rank r+1,
turns it into the gradients of ``S_ext_r`` and ``M_r``, adds ``M_r^T`` of it to its own dL/dS0_r and sends that to
rank r-1. Each rank sends at most one state forward and one backward: traffic per layer is independent of both the
sequence length and cp. The price is latency: a chain over k ranks takes k-1 sequential hops of one small message.

Two transition kinds: ``"matrix"`` (``M`` [H, K, K] acting as ``M @ S`` on ``S`` [H, K, V]; the gated delta rule)
and ``"scalar"`` (``M`` [H] acting as ``M * S`` on ``S`` [H, ...]; Mamba-2 SSD, GLA-style decays).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from cp_core.errors import ContextParallelError
from cp_core.numerics import upcast
from cp_core.packing import PackedRowMetadata
from cp_core.topology import CPTopology

TransitionKind = Literal["matrix", "scalar"]


def _apply(kind: str, m: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    if kind == "matrix":
        return m @ s
    return m.reshape(m.shape + (1,) * (s.dim() - m.dim())) * s


def _apply_transposed(kind: str, m: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return m.transpose(-1, -2) @ g if kind == "matrix" else _apply(kind, m, g)


def _transition_grad(kind: str, g: torch.Tensor, s_in: torch.Tensor, m_shape: torch.Size) -> torch.Tensor:
    if kind == "matrix":
        return g @ s_in.transpose(-1, -2)
    return (g * s_in).reshape(*m_shape, -1).sum(-1)


class _PassStates(torch.autograd.Function):
    @staticmethod
    def forward(ctx, final_state, transition, anchor, kind, start_ranks, topology):
        rank, size, group = topology.rank, topology.size, topology.group
        from_prev = start_ranks[rank] < rank  # my first document began on an earlier rank
        to_next = rank + 1 < size and start_ranks[rank + 1] <= rank  # my last document continues on the next rank
        through = to_next and start_ranks[rank + 1] < rank  # ... and it is my first document too
        state = upcast(final_state)
        transition = upcast(transition).to(state.dtype)
        initial = torch.zeros_like(state)
        if from_prev:
            dist.recv(initial, dist.get_global_rank(group, rank - 1), group=group)
        if to_next:
            outgoing = state + _apply(kind, transition, initial) if through else state
            dist.send(outgoing.contiguous(), dist.get_global_rank(group, rank + 1), group=group)
        ctx.kind, ctx.topology, ctx.flags = kind, topology, (from_prev, to_next, through)
        ctx.dtypes = (final_state.dtype, transition.dtype)
        ctx.save_for_backward(transition, initial)
        return initial

    @staticmethod
    def backward(ctx, grad_initial):
        transition, initial = ctx.saved_tensors
        from_prev, to_next, through = ctx.flags
        kind, group, rank = ctx.kind, ctx.topology.group, ctx.topology.rank
        grad_initial = grad_initial.to(initial.dtype).contiguous()
        grad_state = torch.zeros_like(initial)
        grad_transition = torch.zeros_like(transition)
        if to_next:  # dL/dS0_{r+1}, later ranks included, is the gradient of what I sent
            dist.recv(grad_state, dist.get_global_rank(group, rank + 1), group=group)
            if through:
                grad_transition = _transition_grad(kind, grad_state, initial, transition.shape)
                grad_initial = grad_initial + _apply_transposed(kind, transition, grad_state)
        if from_prev:
            dist.send(grad_initial.contiguous(), dist.get_global_rank(group, rank - 1), group=group)
        return grad_state.to(ctx.dtypes[0]), grad_transition.to(ctx.dtypes[1]), None, None, None, None


def pass_states(
    final_state: torch.Tensor,
    transition: torch.Tensor,
    metadata: PackedRowMetadata,
    topology: CPTopology,
    kind: TransitionKind,
    anchor: torch.Tensor | None = None,
) -> torch.Tensor:
    """Initial state (at least fp32) of this rank's first document, passed down the chain of ranks.

    ``final_state`` (``S_ext``) and ``transition`` (``M``) describe this rank's last local document stretch from a
    zero state; ranks whose last document ends inside the shard may pass anything of the right shape (nobody reads
    it). Returns zeros when the first document starts on this rank. Collective: every rank must call it, and the
    result must take part in every rank's loss (use it even when zero) so that every rank runs its backward.
    ``anchor`` (any tensor of the layer's graph) makes the result require grad exactly when the layer does.
    """
    if kind not in ("matrix", "scalar"):
        raise ContextParallelError(f"transition kind must be 'matrix' or 'scalar', got {kind!r}")
    if not topology.enabled:
        return torch.zeros_like(upcast(final_state))
    if metadata.cp_size != topology.size or metadata.cp_rank != topology.rank:
        raise ContextParallelError(
            f"metadata is for rank {metadata.cp_rank} of cp={metadata.cp_size}, topology is rank {topology.rank} "
            f"of cp={topology.size}"
        )
    anchor = anchor if anchor is not None else final_state
    return _PassStates.apply(final_state, transition, anchor, kind, metadata.doc_start_rank_by_rank, topology)
