"""Ring attention: context parallelism for attention whose memory does not grow with the row.

All-gather KV (:mod:`cp_core.kv_gather`) holds the whole row's keys and values on every rank while a layer's
attention runs, and a zeroed row-sized buffer for their gradients in backward: ``2 S 2 Hkv D`` elements, 4 GiB a
layer at 1M tokens for Qwen3.5-0.8B (2 KV heads of 256, bf16), the term that keeps cp 32 .. 64 above 1.15x the
ideal per-rank memory. Here the keys and values travel instead:

- Forward: each rank's ``[S / cp, Hkv, D]`` key and value shard (a *block*) passes around the ring of ranks, one
  hop a step, the next hop in flight while the current block is used. A rank attends its queries against every
  block it needs as it passes and merges the partial outputs by their log-sum-exp, the way FlashAttention merges
  its tiles. It keeps for backward only its own q, k, v, the output and the log-sum-exp.
- Backward: the blocks go around again with their key and value gradients beside them; each rank adds its queries'
  share (the FlashAttention backward of one key block needs only the whole row's output and log-sum-exp, so the
  split is exact) and the gradients end on the blocks' owners.
- Queries are balanced as all-gather KV balances them (:func:`~cp_core.kv_gather.balanced_stretches`: rank pairs
  swap half their queries where one document spans the row) where that does not lengthen the ring, and the ring
  makes only as many hops as the farthest block any rank needs: ``cp - 1`` for a document spanning the row, one for
  documents no longer than a shard (:func:`ring_layout`).

Against all-gather KV, per rank and layer: the same ``hops S/cp 2 Hkv D`` elements forward and twice that
backward (the blocks again and their gradients, where all-gather KV reduce-scatters the gradients only); two
blocks and their gradients alive instead of the row and its gradient. No sliding window: windowed attention runs
Ulysses or all-gather KV.

Kernels: one varlen call per (query range, key range) pair that also returns the log-sum-exp, and a backward that
takes the merged output and log-sum-exp: torch's built-in FlashAttention-2 (``aten._flash_attention_forward`` /
``_backward``, the kernels ``torch.nn.attention.varlen.varlen_attn`` runs) on CUDA fp16/bf16 tensors, and
:func:`reference_block_forward` / :func:`reference_block_backward` (fp32 or fp64 math; the tests' oracle)
elsewhere (:mod:`cp_core.kv_ring_kernels`). Which query rows meet which block at each step is planned on the host
by :mod:`cp_core.kv_ring_plan`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from cp_core.document_bounds import RowBounds
from cp_core.errors import ContextParallelError
from cp_core.kv_ring_kernels import (
    FLASH_KERNELS,
    REFERENCE_KERNELS,
    BlockKernels,
    flash_block_backward,
    flash_block_forward,
    reference_block_backward,
    reference_block_forward,
    resolve_ring_kernels,
)
from cp_core.kv_ring_plan import BlockCall, RingPlan, block_calls, ring_layout, ring_plan, ring_plans
from cp_core.packing import PackedRowMetadata
from cp_core.sharding import exchange_p2p
from cp_core.topology import CPTopology
from cp_core.varlen_attention import AttentionBackend, check_attention_shard, varlen_causal_attention

__all__ = [  # the kernels and the plan live in kv_ring_kernels and kv_ring_plan; their names are re-exported here
    "FLASH_KERNELS",
    "REFERENCE_KERNELS",
    "BlockCall",
    "BlockKernels",
    "RingPlan",
    "block_calls",
    "flash_block_backward",
    "flash_block_forward",
    "kv_ring_attention",
    "reference_block_backward",
    "reference_block_forward",
    "resolve_ring_kernels",
    "ring_layout",
    "ring_plan",
    "ring_plans",
]


def _shift(tensors: Sequence[torch.Tensor], send_to: int, recv_from: int, topology: CPTopology):
    """Post sends of ``tensors`` to group rank ``send_to`` and receives of as many from ``recv_from``; returns the
    pending works and the receive buffers (valid once the works are waited on)."""
    group, ops, received = topology.group, [], []
    for tensor in tensors:
        buffer = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        ops.append(dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, send_to), group))
        ops.append(dist.P2POp(dist.irecv, buffer, dist.get_global_rank(group, recv_from), group))
        received.append(buffer)
    return dist.batch_isend_irecv(ops), received


def _wait(pending) -> list[torch.Tensor]:
    works, received = pending
    for work in works:
        work.wait()
    return received


def _bounds(
    plan: RingPlan, device: torch.device, row: RowBounds | None = None
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Each call's ``cu_q`` and ``cu_k`` (int32), step by step: views of the plan's table, moved to ``device`` in
    one copy (with the row's kernel bounds ``row``, once per row for all layers)."""
    if row is not None:
        table = row.int32_table(plan.bound_table)
    else:
        table = torch.tensor(plan.bound_table, dtype=torch.int32).to(device, non_blocking=True)
    bounds = []
    for calls, starts in zip(plan.calls, plan.bound_starts, strict=True):
        bounds.append([])
        for call, at in zip(calls, starts, strict=True):
            middle = at + len(call.q_lens) + 1
            bounds[-1].append((table[at:middle], table[middle : middle + len(call.k_lens) + 1]))
    return bounds


def _swap_second_half(x: torch.Tensor, partner: int | None, topology: CPTopology) -> torch.Tensor:
    """``x`` with its second half exchanged for the partner's (``x`` itself without a partner)."""
    if partner is None:
        return x
    half = x.size(0) // 2
    theirs = exchange_p2p(x[half:], x[half:].shape, partner, partner, topology)
    return torch.cat([x[:half], theirs])


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: RingPlan, topology: CPTopology, scale: float, kernels: BlockKernels, row=None):
        cp, rank = topology.size, topology.rank
        queries = _swap_second_half(q, plan.partner, topology).contiguous()
        bounds = _bounds(plan, torch.device("cpu"), None) if kernels.on_host else _bounds(plan, q.device, row)
        compute = torch.promote_types(q.dtype, torch.float32)
        out = q.new_zeros((*queries.shape[:2], v.size(2)), dtype=compute)
        lse = q.new_full((q.size(1), q.size(0)), float("-inf"), dtype=compute)
        block = [k.contiguous(), v.contiguous()]
        for step, calls in enumerate(plan.calls):
            pending = _shift(block, (rank + 1) % cp, (rank - 1) % cp, topology) if step < plan.hops else None
            for call, (cu_q, cu_k) in zip(calls, bounds[step], strict=True):
                (r0, r1), (k0, k1) = call.rows, call.keys
                out_c, lse_c = kernels.forward(
                    queries[r0:r1], block[0][k0:k1], block[1][k0:k1], cu_q, cu_k,
                    max(call.q_lens), max(call.k_lens), call.causal, scale,
                )  # fmt: skip
                merged = torch.logaddexp(lse[:, r0:r1], lse_c)
                keep = (lse[:, r0:r1] - merged).exp().transpose(0, 1).unsqueeze(-1)
                add = (lse_c - merged).exp().transpose(0, 1).unsqueeze(-1)
                out[r0:r1].mul_(keep).addcmul_(out_c, add)  # in place: no stretch-sized fp32 temporaries
                lse[:, r0:r1] = merged
            if pending is not None:
                block = _wait(pending)
        out = out.to(q.dtype)
        ctx.save_for_backward(queries, k, v, out, lse)
        ctx.plan, ctx.topology, ctx.scale, ctx.kernels, ctx.bounds = plan, topology, scale, kernels, bounds
        return _swap_second_half(out, plan.partner, topology)

    @staticmethod
    def backward(ctx, grad):
        queries, k, v, out, lse = ctx.saved_tensors
        plan, topology, kernels, bounds = ctx.plan, ctx.topology, ctx.kernels, ctx.bounds
        cp, rank = topology.size, topology.rank
        ahead, behind = (rank + 1) % cp, (rank - 1) % cp
        dout = _swap_second_half(grad, plan.partner, topology).contiguous()
        compute = torch.promote_types(queries.dtype, torch.float32)
        dq = torch.zeros_like(queries, dtype=compute)
        block = [k.contiguous(), v.contiguous()]
        # Each block's gradients travel with it in the keys' dtype: a rank adds its share, summed over its calls in
        # fp32, to what the previous ranks sent, rounding once per hop as a ring reduce-scatter does. The sum goes
        # out while the next block's share is computed.
        incoming_grads = None
        for step, calls in enumerate(plan.calls):
            pending = _shift(block, ahead, behind, topology) if step < plan.hops else None
            share = [torch.zeros_like(t, dtype=compute) for t in block]
            for call, (cu_q, cu_k) in zip(calls, bounds[step], strict=True):
                (r0, r1), (k0, k1) = call.rows, call.keys
                dq_c, dk_c, dv_c = kernels.backward(
                    dout[r0:r1], queries[r0:r1], block[0][k0:k1], block[1][k0:k1], out[r0:r1],
                    lse[:, r0:r1].contiguous(), cu_q, cu_k, max(call.q_lens), max(call.k_lens),
                    call.causal, ctx.scale,
                )  # fmt: skip
                dq[r0:r1] += dq_c
                share[0][k0:k1] += dk_c
                share[1][k0:k1] += dv_c
            if incoming_grads is not None:
                for mine, theirs in zip(share, _wait(incoming_grads), strict=True):
                    mine += theirs
            dblock = [g.to(t.dtype) for g, t in zip(share, block, strict=True)]
            if pending is not None:
                incoming_grads = _shift(dblock, ahead, behind, topology)
                block = _wait(pending)
        if plan.hops:  # this rank holds block (rank - hops)'s gradients: back to their owner
            dblock = _wait(_shift(dblock, (rank - plan.hops) % cp, (rank + plan.hops) % cp, topology))
        dq = _swap_second_half(dq.to(queries.dtype), plan.partner, topology)
        return dq, dblock[0], dblock[1], None, None, None, None, None


def kv_ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    metadata: PackedRowMetadata,
    topology: CPTopology,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    backend: AttentionBackend = "auto",
    balance: bool = True,
) -> torch.Tensor:
    """Causal varlen attention of this rank's queries against the row's keys and values passed around the ring.

    q [S/cp, Hq, D], k and v [S/cp, Hkv, D] (this rank's tokens); returns [S/cp, Hq, Dv], the rows an unsharded
    run computes for these tokens. ``balance``: rank pairs swap half their queries where that evens the causal
    work without lengthening the ring (:func:`ring_layout`). Under CP a ``sliding_window`` raises (use Ulysses or
    all-gathered KV). Without CP it is plain varlen attention over ``metadata``'s documents.
    """
    check_attention_shard(q, k, v, metadata, topology)
    if not topology.enabled:
        return varlen_causal_attention(
            q, k, v, metadata.cu_seqlens, metadata.max_seqlen, scale=scale, sliding_window=sliding_window,
            backend=backend,
        )  # fmt: skip
    if sliding_window is not None:
        raise ContextParallelError(
            f"ring attention takes no sliding window (got sliding_window={sliding_window}): use attention CP style "
            "'ulysses' or 'kv_gather' for windowed attention"
        )
    kernels = resolve_ring_kernels(backend, q, v)
    plan = ring_plan(metadata.seq_lens, topology.size, topology.rank, balance)
    scale = q.size(-1) ** -0.5 if scale is None else scale
    row = None if kernels.on_host else metadata.kernel_bounds(q.device)
    return _RingAttention.apply(q, k, v, plan, topology, scale, kernels, row)
