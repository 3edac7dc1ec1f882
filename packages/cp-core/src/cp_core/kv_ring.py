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
elsewhere.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cp_core.document_bounds import RowBounds
from cp_core.errors import ContextParallelError
from cp_core.kv_gather import QueryStretch, balanced_stretches, query_stretch
from cp_core.packing import PackedRowMetadata, build_packed_metadata
from cp_core.sharding import exchange_p2p
from cp_core.topology import CPTopology
from cp_core.varlen_attention import (
    AttentionBackend,
    _causal_mask,
    check_attention_shard,
    resolve_attention_backend,
    varlen_causal_attention,
)

# --------------------------------------------------------------------------------------------------------
# Block kernels: attention of packed query ranges against key ranges with the log-sum-exp, and the backward given
# the whole row's output and log-sum-exp. Layout as flash-attn's varlen: q [Tq, Hq, D], k/v [Tk, Hkv, D],
# documents by cu_q / cu_k (int32); lse [Hq, Tq]. ``causal``: each document's keys are its queries' own positions
# (equal lengths); otherwise every key precedes every query of its document (no mask).


def _document_scores(q, k, v, cu_q, cu_k, causal: bool, scale: float):
    """Per document of a block: its rows ``(q0, q1)``, its q, k, v in fp32 (fp64 for fp64 inputs; k and v repeated
    to the query heads) and its masked scores ``[H, q, k]``."""
    compute = torch.promote_types(q.dtype, torch.float32)
    group = q.size(1) // k.size(1)
    for (q0, q1), (k0, k1) in zip(_pairs(cu_q), _pairs(cu_k), strict=True):
        qd = q[q0:q1].to(compute)
        kd, vd = (t[k0:k1].to(compute).repeat_interleave(group, dim=1) for t in (k, v))
        scores = torch.einsum("ihd,jhd->hij", qd, kd) * scale
        if causal:
            scores = scores.masked_fill(~_causal_mask(q1 - q0, k1 - k0, None, q.device), float("-inf"))
        yield (q0, q1), qd, kd, vd, scores


def reference_block_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal: bool, scale: float):
    """Torch reference of a block's attention: ``(out, lse)`` in fp32 (fp64 for fp64 inputs)."""
    outputs, lses = [], []
    for _, _, _, vd, scores in _document_scores(q, k, v, cu_q, cu_k, causal, scale):
        lse = scores.logsumexp(-1)
        outputs.append(torch.einsum("hij,jhd->ihd", (scores - lse[..., None]).exp(), vd))
        lses.append(lse)
    return torch.cat(outputs), torch.cat(lses, dim=1)


def reference_block_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal: bool, scale: float):
    """Torch reference of a block's backward: ``(dq, dk, dv)`` of this block's share, from the row's ``out`` and
    ``lse`` (the probabilities are ``exp(scores - lse)``; ``rowsum(dout * out)`` is the softmax's correction)."""
    heads_kv, group = k.size(1), q.size(1) // k.size(1)
    dqs, dks, dvs = [], [], []
    for (q0, q1), qd, kd, vd, scores in _document_scores(q, k, v, cu_q, cu_k, causal, scale):
        do, od = (t[q0:q1].to(qd.dtype) for t in (dout, out))
        probs = (scores - lse[:, q0:q1, None].to(qd.dtype)).exp()
        dvs.append(torch.einsum("hij,ihd->jhd", probs, do))
        dprobs = torch.einsum("ihd,jhd->hij", do, vd)
        correction = (do * od).sum(-1).transpose(0, 1)  # [H, i]
        dscores = probs * (dprobs - correction[..., None])
        dqs.append(torch.einsum("hij,jhd->ihd", dscores, kd) * scale)
        dks.append(torch.einsum("hij,ihd->jhd", dscores, qd) * scale)

    def per_kv_head(t: torch.Tensor) -> torch.Tensor:
        return t.view(t.size(0), heads_kv, group, t.size(2)).sum(2)

    return torch.cat(dqs), per_kv_head(torch.cat(dks)), per_kv_head(torch.cat(dvs))


def _pairs(cu: torch.Tensor) -> list[tuple[int, int]]:
    bounds = cu.tolist()
    return list(itertools.pairwise(bounds))


def flash_block_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal: bool, scale: float):
    """torch's FlashAttention-2 forward: ``(out, lse)``, out in q's dtype, lse fp32 ``[Hq, Tq]``."""
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale
    )
    return out, lse


@functools.cache
def _flash_lse_is_packed(device: torch.device) -> bool:
    """Whether torch's flash kernels return the varlen log-sum-exp as ``[heads, tokens]`` (older flash-attn 2
    releases padded it per document), probed once per device with a two-document call."""
    q = torch.zeros(3, 2, 8, device=device, dtype=torch.bfloat16)
    kv = torch.zeros(3, 1, 8, device=device, dtype=torch.bfloat16)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32, device=device)
    _, lse = flash_block_forward(q, kv, kv, cu, cu, 2, 2, True, 1.0)
    return tuple(lse.shape) == (2, 3)


def flash_block_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal: bool, scale: float):
    """torch's FlashAttention-2 backward of one block, from the row's ``out`` and ``lse``."""
    no_dropout = torch.zeros(2, dtype=torch.uint64, device=q.device)  # the rng state; unread without dropout
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, no_dropout, unused, scale=scale
    )
    return dq, dk, dv


@dataclass(frozen=True)
class BlockKernels:
    forward: Callable
    backward: Callable
    on_host: bool
    """Whether the kernels read the document bounds on the host (the reference) or on q's device."""


REFERENCE_KERNELS = BlockKernels(reference_block_forward, reference_block_backward, on_host=True)
FLASH_KERNELS = BlockKernels(flash_block_forward, flash_block_backward, on_host=False)


def resolve_ring_kernels(backend: str, q: torch.Tensor, v: torch.Tensor) -> BlockKernels:
    """The block kernels for ``backend`` and these tensors; raises when a forced fast backend cannot run them."""
    chosen = resolve_attention_backend(backend, q)
    if chosen == "torch":
        return REFERENCE_KERNELS
    problems = []
    if not torch.backends.cuda.is_flash_attention_available():
        problems.append("this torch build has no flash attention kernels")
    if q.size(-1) != v.size(-1) or q.size(-1) > 256 or q.size(-1) % 8:
        problems.append(f"flash attention needs one head dim <= 256 and a multiple of 8, got q {q.size(-1)}, "
                        f"v {v.size(-1)}")  # fmt: skip
    elif not problems and not _flash_lse_is_packed(q.device):
        problems.append(f"torch {torch.__version__}'s flash kernels pad the log-sum-exp per document")
    if problems:
        raise ContextParallelError(
            f"ring attention cannot use its flash kernels ({'; '.join(problems)}); use attention CP style "
            "'kv_gather', or backend='torch' for the reference"
        )
    return FLASH_KERNELS


# --------------------------------------------------------------------------------------------------------
# The plan: which query rows meet which key rows of which block, the same on every rank.


@dataclass(frozen=True)
class BlockCall:
    """One kernel call: rows ``rows`` of the attended queries against rows ``keys`` of the current block, as
    documents of ``q_lens`` queries and ``k_lens`` keys; ``causal`` for the queries' own keys (the diagonal), else
    every key comes before every query of its document (the first document's keys on earlier ranks)."""

    rows: tuple[int, int]
    keys: tuple[int, int]
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    causal: bool


def block_calls(stretches: Sequence[QueryStretch], block_start: int, block_end: int) -> list[BlockCall]:
    """The calls of ``stretches`` (attended one after another, their rows concatenated) against the global key
    block ``[block_start, block_end)``. A stretch lies inside one block (it is a shard or half of one), and only its
    first document can have keys before it, so a block gives a stretch at most a diagonal call and a call of its
    first piece against earlier keys."""
    calls, row = [], 0
    for stretch in stretches:
        length = stretch.end - stretch.start
        if stretch.keys_before:
            first, last = max(block_start, stretch.key_start), min(block_end, stretch.start)
            if first < last:
                piece = stretch.seq_lens[0]
                keys = (first - block_start, last - block_start)
                calls.append(BlockCall((row, row + piece), keys, (piece,), (last - first,), causal=False))
        if block_start <= stretch.start and stretch.end <= block_end:
            keys = (stretch.start - block_start, stretch.end - block_start)
            calls.append(BlockCall((row, row + length), keys, stretch.seq_lens, stretch.seq_lens, causal=True))
        row += length
    return calls


@dataclass(frozen=True)
class RingPlan:
    """One rank's ring: the query stretches it attends, the partner it swaps half its queries with (None: no
    swap), the hops every rank makes (the same on all of them), and per step ``t = 0 .. hops`` its calls against
    the block it then holds, rank ``(rank - t) % cp``'s."""

    stretches: tuple[QueryStretch, ...]
    partner: int | None
    hops: int
    calls: tuple[tuple[BlockCall, ...], ...]
    bound_table: tuple[int, ...]
    """Every call's ``cu_q`` then ``cu_k``, step by step, one flat table (moved to the kernels' device per forward)."""
    bound_starts: tuple[tuple[int, ...], ...]
    """Per step, where each call's bounds begin in ``bound_table``."""


def _last_step(rank: int, cp: int, first_block: int, last_block: int) -> int:
    """The last ring step at which ``rank`` holds one of blocks ``first_block .. last_block`` (block ``x`` is there at
    step ``(rank - x) % cp``): the earliest block at or before ``rank``, or the first block after it, which comes
    round last."""
    steps = []
    if first_block <= rank:
        steps.append(rank - first_block)
    if last_block > rank:
        steps.append(cp + rank - max(first_block, rank + 1))
    return max(steps)


def _steps_needed(stretches: Sequence[QueryStretch], rank: int, cp: int, local: int) -> int:
    return max(_last_step(rank, cp, s.key_start // local, (s.end - 1) // local) for s in stretches)


@functools.lru_cache(maxsize=8)
def ring_layout(
    seq_lens: tuple[int, ...], cp: int, balance: bool = True
) -> tuple[tuple[tuple[QueryStretch, ...], ...], tuple[int | None, ...], int]:
    """Every rank's query stretches and partner, and the hops of the ring, for a row of documents ``seq_lens`` over
    ``cp`` ranks (a pure function of its arguments, cached: every attention layer of a step asks for the same row).

    Balancing is all-gathered KV's (:func:`~cp_core.kv_gather.balanced_stretches`), with one more rule: a pair swaps
    only if neither rank then needs a block later than the unbalanced ring's last step. Keys travel one way, so a
    rank attending its partner's queries waits for blocks from the far side of the ring: for documents shorter than
    a shard a swap would stretch the ring from one hop to ``cp - 1`` (each a block sent forward and a block and its
    gradient backward) to even out a little compute. For a document spanning the row every rank needs ``cp - 1``
    hops anyway, and the pairs swap as under all-gathered KV."""
    metadata = build_packed_metadata(seq_lens, 0, cp)
    local = metadata.local_len
    own = [(query_stretch(metadata, r * local, (r + 1) * local),) for r in range(cp)]
    unbalanced_hops = max(_steps_needed(own[r], r, cp, local) for r in range(cp))
    stretches: list[tuple[QueryStretch, ...]] = list(own)
    partners: list[int | None] = [None] * cp
    if balance:
        for rank in range(cp // 2):
            partner = cp - 1 - rank
            mine, swapped = balanced_stretches(metadata, rank=rank)
            if swapped is None:
                continue
            theirs, _ = balanced_stretches(metadata, rank=partner)
            if max(_steps_needed(mine, rank, cp, local), _steps_needed(theirs, partner, cp, local)) > unbalanced_hops:
                continue
            stretches[rank], stretches[partner] = tuple(mine), tuple(theirs)
            partners[rank], partners[partner] = partner, rank
    hops = max(_steps_needed(stretches[r], r, cp, local) for r in range(cp))
    return tuple(stretches), tuple(partners), hops


@functools.lru_cache(maxsize=8)
def ring_plan(seq_lens: tuple[int, ...], cp: int, rank: int, balance: bool = True) -> RingPlan:
    """Rank ``rank``'s :class:`RingPlan` (see :func:`ring_layout`; cached)."""
    stretches, partners, hops = ring_layout(seq_lens, cp, balance)
    local = sum(seq_lens) // cp
    calls, table, starts = [], [], []
    for step in range(hops + 1):
        block = (rank - step) % cp
        calls.append(tuple(block_calls(stretches[rank], block * local, (block + 1) * local)))
        starts.append([])
        for call in calls[-1]:
            starts[-1].append(len(table))
            for lens in (call.q_lens, call.k_lens):
                table.extend(itertools.accumulate(lens, initial=0))
    return RingPlan(stretches[rank], partners[rank], hops, tuple(calls), tuple(table), tuple(tuple(s) for s in starts))


def ring_plans(seq_lens: tuple[int, ...], cp: int, balance: bool = True) -> tuple[RingPlan, ...]:
    """Every rank's :class:`RingPlan`."""
    return tuple(ring_plan(tuple(seq_lens), cp, rank, balance) for rank in range(cp))


# --------------------------------------------------------------------------------------------------------
# The ring


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
