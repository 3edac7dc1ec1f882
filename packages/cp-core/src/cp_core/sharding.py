"""Contiguous sequence sharding and its inverse (an autograd all-gather).

Rank ``r`` of ``cp`` keeps tokens ``[r * S / cp, (r + 1) * S / cp)``. Shapes are checked before any
collective so that bad input raises the same error on every rank instead of hanging one of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist

from cp_core.errors import ContextParallelError
from cp_core.packing import check_divisible
from cp_core.topology import CPTopology

GatherBackward = Literal["slice", "sum"]


def check_batch_one(x: torch.Tensor, topology: CPTopology, batch_dim: int, what: str) -> None:
    """CP shards one packed row; raise if ``x`` holds more than one row while CP is on."""
    if topology.enabled and x.size(batch_dim) != 1:
        raise ContextParallelError(
            f"{what} has batch size {x.size(batch_dim)} (shape {tuple(x.shape)}), but context parallelism "
            "shards one packed row: use micro-batch size 1 and pack documents into the row instead"
        )


def shard_sequence(x: torch.Tensor, topology: CPTopology, dim: int = 0) -> torch.Tensor:
    """This rank's contiguous shard of ``x`` along ``dim`` (a view; gradients flow back into ``x``)."""
    if not topology.enabled:
        return x
    check_divisible(x.size(dim), topology.size, what=f"sequence length (dim {dim} of shape {tuple(x.shape)})")
    local = x.size(dim) // topology.size
    return x.narrow(dim, topology.rank * local, local)


def shard_position_ids(position_ids: torch.Tensor, topology: CPTopology) -> torch.Tensor:
    """Shard 1-D-rope position ids of shape [B, S] (B must be 1 under CP) along the sequence."""
    if position_ids.dim() != 2:
        raise ContextParallelError(f"position_ids must be [B, S], got shape {tuple(position_ids.shape)}")
    check_batch_one(position_ids, topology, 0, "position_ids")
    return shard_sequence(position_ids, topology, dim=1)


def shard_mrope_positions(position_ids: torch.Tensor, topology: CPTopology) -> torch.Tensor:
    """Shard 3-D MRoPE position ids of shape [3, B, S] (t, h, w; B must be 1 under CP) along the sequence."""
    if position_ids.dim() != 3 or position_ids.size(0) != 3:
        raise ContextParallelError(
            f"MRoPE position ids must be [3, B, S] (temporal, height, width), got shape {tuple(position_ids.shape)}"
        )
    check_batch_one(position_ids, topology, 1, "MRoPE position ids")
    return shard_sequence(position_ids, topology, dim=2)


def _as_ints(values) -> tuple[int, ...]:
    """``values`` (a sequence or tensor of numbers) as ints; one sentinel for anything else, the same on every rank
    (the local checks that follow then raise it everywhere alike)."""
    try:
        if isinstance(values, torch.Tensor):
            values = values.flatten().tolist()
        return tuple(int(v) for v in values)
    except (TypeError, ValueError, RuntimeError):
        return (-1, -1)


def check_same_row_on_every_rank(
    seq_lens: Sequence[int] | torch.Tensor,
    topology: CPTopology,
    device: torch.device | str = "cpu",
    extra: Sequence[int] | torch.Tensor = (),
    problem: BaseException | str | None = None,
) -> None:
    """Raise on every rank unless every rank of ``topology`` was given the same packed row and none found a problem
    with its own inputs.

    The row is its global document lengths ``seq_lens`` and ``extra`` (other values all ranks must share, e.g. the
    shapes of the tensors a rank holds or a VL row's image grids). Ranks given different rows would exchange
    mismatched halos, states and key blocks: wrong numbers, or a rank waiting in an exchange its peer never enters.
    ``problem`` is what this rank's own input checks raised (or None): that rank raises it, and every other rank a
    ContextParallelError naming it, instead of waiting in the next collective for a rank that has stopped. Call it
    before any check that could raise on one rank only: the inputs are compared raw, so once they agree, every
    local check fails alike. Rows with the same lengths but other tokens are not told apart. Costs one all-reduce
    of three int64 on ``device`` (CUDA under NCCL) and a host sync, once per row (a ``fake`` group's no-op
    all-reduce passes)."""
    if not topology.enabled:
        if problem is not None:
            raise problem if isinstance(problem, BaseException) else ContextParallelError(problem)
        return
    fingerprint = hash((_as_ints(seq_lens), _as_ints(extra))) % 2**62  # tuples of ints hash alike in every process
    failed = int(problem is not None)
    state = torch.tensor([fingerprint, -fingerprint, failed], dtype=torch.int64, device=device)
    dist.all_reduce(state, op=dist.ReduceOp.MAX, group=topology.group)
    highest, lowest, any_failed = state.tolist()
    if any_failed:  # every rank comes here alike
        mine = torch.tensor([failed], dtype=torch.int64, device=device)
        failing = [rank for rank, flag in enumerate(all_gather_rows(mine, topology).tolist()) if flag]
        if problem is not None:
            raise problem if isinstance(problem, BaseException) else ContextParallelError(problem)
        raise ContextParallelError(
            f"CP rank(s) {failing} rejected their inputs for this row (their error names the problem); rank "
            f"{topology.rank} stops here too, so that no rank waits in a collective for them"
        )
    if highest != -lowest:  # the same on every rank, so every rank comes here and names the odd ones
        mine = torch.tensor([fingerprint], dtype=torch.int64, device=device)
        fingerprints = all_gather_rows(mine, topology).tolist()
        differ = [rank for rank, other in enumerate(fingerprints) if other != fingerprints[0]]
        raise ContextParallelError(
            f"the ranks of the CP group hold different packed rows: rank(s) {differ} got other document lengths "
            "or input shapes than rank 0; every CP rank must get the same row's global document lengths "
            "(seq_lens) and its own shard of that row, with tensors of the same shapes"
        )


def all_gather_rows(x: torch.Tensor, topology: CPTopology) -> torch.Tensor:
    """Every rank's ``x`` concatenated along dim 0 in rank order (no autograd)."""
    out = x.new_empty((topology.size * x.size(0), *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=topology.group)
    return out


def reduce_scatter_rows(x: torch.Tensor, topology: CPTopology) -> torch.Tensor:
    """This rank's ``1 / size`` of dim 0 of ``x``, summed over the ranks (no autograd)."""
    out = x.new_empty((x.size(0) // topology.size, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous(), op=dist.ReduceOp.SUM, group=topology.group)
    return out


def exchange_p2p(
    tensor: torch.Tensor, recv_shape, send_to: int | None, recv_from: int | None, topology: CPTopology
) -> torch.Tensor | None:
    """Send ``tensor`` to group rank ``send_to`` and receive a ``recv_shape`` tensor (contiguous, ``tensor``'s dtype)
    from ``recv_from`` in one batch; either may be None. Returns what was received (None without ``recv_from``)."""
    received = None
    ops = []
    group = topology.group
    if send_to is not None:
        ops.append(dist.P2POp(dist.isend, tensor.contiguous(), dist.get_global_rank(group, send_to), group))
    if recv_from is not None:
        received = torch.empty(recv_shape, dtype=tensor.dtype, device=tensor.device)
        ops.append(dist.P2POp(dist.irecv, received, dist.get_global_rank(group, recv_from), group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return received


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, topology: CPTopology, backward: GatherBackward) -> torch.Tensor:
        ctx.topology, ctx.backward_mode = topology, backward
        return all_gather_rows(x, topology)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        topology: CPTopology = ctx.topology
        local = grad.size(0) // topology.size
        if ctx.backward_mode == "slice":
            return grad.narrow(0, topology.rank * local, local).contiguous(), None, None
        return reduce_scatter_rows(grad, topology), None, None


def gather_sequence(
    x: torch.Tensor, topology: CPTopology, dim: int = 0, backward: GatherBackward = "slice"
) -> torch.Tensor:
    """All-gather the shards of every rank along ``dim``, with autograd.

    ``backward`` says how the gathered tensor is used afterwards:

    - ``"slice"``: every rank computes the same thing from the full tensor (replicated work), so each
      rank's shard gets its own slice of the gradient and nothing is communicated.
    - ``"sum"``: ranks use the full tensor differently (e.g. each keeps a different part of what it
      computes), so the shard's gradient is the sum over ranks (a reduce-scatter).
    """
    if backward not in ("slice", "sum"):
        raise ContextParallelError(f"backward must be 'slice' or 'sum', got {backward!r}")
    if not topology.enabled:
        return x
    moved = x.movedim(dim, 0)
    return _GatherSequence.apply(moved, topology, backward).movedim(0, dim)


def gather_variable(x: torch.Tensor, counts: list[int] | tuple[int, ...], topology: CPTopology) -> torch.Tensor:
    """All-gather rows of different counts per rank along dim 0, with autograd: ``[sum(counts), *x.shape[1:]]``.

    ``counts[r]`` is the number of rows rank ``r`` holds (host values every rank shares; ``x.size(0)`` must equal
    ``counts[rank]``). Rows are padded to the largest count for one all-gather and unpadded after. Backward is a
    reduce-scatter: each rank's rows get the sum of every rank's gradient for them (ranks use the gathered rows
    differently, e.g. each merges a different part into its own shard).
    """
    counts = [int(c) for c in counts]
    if len(counts) != topology.size:
        raise ContextParallelError(f"counts {counts} must give one row count per rank of cp={topology.size}")
    if x.size(0) != counts[topology.rank]:
        raise ContextParallelError(
            f"rank {topology.rank} holds {x.size(0)} rows but counts[{topology.rank}]={counts[topology.rank]}"
        )
    if not topology.enabled:
        return x
    most = max(counts)
    if most == 0:
        return x
    padded = torch.cat([x, x.new_zeros(most - x.size(0), *x.shape[1:])]) if x.size(0) < most else x
    gathered = gather_sequence(padded, topology, dim=0, backward="sum")
    return torch.cat([gathered[r * most : r * most + n] for r, n in enumerate(counts)])
