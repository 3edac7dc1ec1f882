"""All-gather-KV context parallelism for attention: any cp, whatever the head counts.

Each rank gathers the keys and values of the whole row (one all-gather of its ``[S / cp, 2 Hkv, D]`` forward, a
reduce-scatter of their gradients backward) and attends a contiguous stretch of queries, its own ``[S / cp, Hq,
D]`` (or half of them and half of a partner's, below): each document's piece of the stretch against the document's
keys from its first token, wherever that lies, up to the stretch's last token: varlen attention whose key ranges
end where the query ranges end (bottom-right causal alignment, see :mod:`cp_core.varlen_attention`). Nothing else
changes, so it is exact like Ulysses.

Against Ulysses (:mod:`cp_core.ulysses`), which needs cp to divide the query heads:

- any cp, e.g. cp = 16 .. 64 for a model with 8 query heads;
- a rank sends its ``S / cp`` tokens' K and V to every other rank, ``2 Hkv D (cp - 1) S / cp`` elements forward
  and as many gradients backward, where Ulysses sends ``(cp - 1) / cp`` of its tokens' q, k, v and output,
  ``(2 Hq + 2 max(Hkv, cp)) D S / cp`` elements each way: fewer bytes while ``Hkv cp < Hq + max(Hkv, cp)``
  (grouped-query models at small cp), more beyond;
- the gathered row stays alive for backward (the attention keeps views of it); attention runs one query head per
  call, so no kernel expands the key gradients to the query heads;
- the work is uneven when each rank keeps its own queries: with one document over the row, rank ``r`` computes
  ``(r + 1/2) (S / cp)^2`` scores, the last rank ``2 - 1/cp`` times the mean. Every rank holds the whole gathered
  row, so ranks ``r`` and ``cp - 1 - r`` swap the second halves of their queries (and the outputs back) wherever
  that cuts the busier one's work by over 3 % (:func:`balanced_stretches`): even work for one spanning document, for
  ``4 (S / cp) / 2 Hq D`` more elements per rank and layer (q and output forward, their gradients backward).
"""

from __future__ import annotations

import bisect
import functools
import itertools
from dataclasses import dataclass

import torch

from cp_core.document_bounds import RowBounds
from cp_core.errors import ContextParallelError
from cp_core.packing import PackedRowMetadata
from cp_core.sharding import all_gather_rows, exchange_p2p, reduce_scatter_rows
from cp_core.topology import CPTopology
from cp_core.varlen_attention import AttentionBackend, check_attention_shard, varlen_causal_attention


class _GatherKeysValues(torch.autograd.Function):
    """All-gather the row's ``k`` and ``v`` and return, for each global key range ``[start, end)`` asked for, each KV
    head's keys then values as outputs of their own, ``[end - start, 1, D]`` views of the gathered buffer; with a
    ``partner`` rank, also swap ``q_send`` with the partner's (the last output: the partner's ``q_send``).

    Separate outputs get their gradients separately (no row-sized zero-filled gradient per slice, as slicing under
    autograd would make); backward writes them all into one zeroed row-sized buffer and reduce-scatters it, after
    swapping the received queries' gradient back. Doing the swap and the gather in one function fixes the order of
    their collectives in backward on every rank (separate autograd nodes could run in either order)."""

    @staticmethod
    def forward(ctx, k, v, q_send, topology: CPTopology, ranges, partner):
        ctx.topology, ctx.ranges, ctx.partner, ctx.local_len = topology, ranges, partner, k.size(0)
        ctx.set_materialize_grads(False)  # an unused head's gradient stays None rather than a zero tensor
        ctx.heads, ctx.dims = k.size(1), (k.size(2), v.size(2))
        ctx.kv_dtypes, ctx.device = (k.dtype, v.dtype), k.device
        fused = k.size(2) == v.size(2) and k.dtype == v.dtype
        rows = [all_gather_rows(torch.cat([k, v], dim=1), topology)] if fused else [
            all_gather_rows(k, topology), all_gather_rows(v, topology)
        ]  # fmt: skip
        ctx.fused = fused
        heads = [rows[0][:, i : i + 1] for i in range(2 * ctx.heads)] if fused else [
            rows[j][:, i : i + 1] for j in (0, 1) for i in range(ctx.heads)
        ]  # fmt: skip
        outputs = [head[start:end] for start, end in ranges for head in heads]
        if partner is not None:
            ctx.q_like = q_send.new_empty(()).expand(q_send.shape)  # shape, dtype and device, one element
            outputs.append(exchange_p2p(q_send, q_send.shape, partner, partner, topology))
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        topology: CPTopology = ctx.topology
        grad_q_send = None
        if ctx.partner is not None:
            *grads, grad_received = grads
            if grad_received is None:  # the partner still waits for a gradient
                grad_received = torch.zeros_like(ctx.q_like)
            grad_q_send = exchange_p2p(grad_received, grad_received.shape, ctx.partner, ctx.partner, topology)
        if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
            # Frozen keys and values (e.g. LoRA on q_proj only): the same on every rank, so no rank joins the
            # reduce-scatter; a rank runs this backward only for its swapped queries' gradient.
            return None, None, grad_q_send, None, None, None
        size = topology.size * ctx.local_len
        zeros = dict(device=ctx.device)
        if ctx.fused:
            buffers = [torch.zeros((size, 2 * ctx.heads, ctx.dims[0]), dtype=ctx.kv_dtypes[0], **zeros)]
        else:
            buffers = [
                torch.zeros((size, ctx.heads, d), dtype=t, **zeros)
                for d, t in zip(ctx.dims, ctx.kv_dtypes, strict=True)
            ]
        per_range = 2 * ctx.heads
        for index, grad in enumerate(grads):
            if grad is None:
                continue
            (start, end), head = ctx.ranges[index // per_range], index % per_range
            buffer, column = (buffers[0], head) if ctx.fused else (buffers[head // ctx.heads], head % ctx.heads)
            buffer[start:end, column : column + 1] += grad
        locals_ = [reduce_scatter_rows(buffer, topology) for buffer in buffers]
        if ctx.fused:
            grad_k, grad_v = locals_[0][:, : ctx.heads], locals_[0][:, ctx.heads :]
        else:
            grad_k, grad_v = locals_
        return grad_k, grad_v, grad_q_send, None, None, None


def gather_kv(
    k: torch.Tensor, v: torch.Tensor, topology: CPTopology, start: int = 0, end: int | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Keys and values ``[start, end)`` of the whole row (default: all of it), one ``[end - start, 1, D]`` tensor per
    KV head, from every rank's ``[S / cp, Hkv, D]`` shards: one all-gather when they share head dim and dtype;
    backward sums every rank's gradient into each shard (a reduce-scatter)."""
    end = topology.size * k.size(0) if end is None else end
    heads = k.size(1)
    both = _GatherKeysValues.apply(k, v, None, topology, ((start, end),), None)
    return list(both[:heads]), list(both[heads:])


@dataclass(frozen=True)
class QueryStretch:
    """A contiguous global stretch ``[start, end)`` of the row's queries and the documents' pieces in it:
    ``seq_lens`` (the pieces' lengths, in order) and ``keys_before`` (keys of the first piece's document that lie
    before ``start`` and that its queries read, the sliding window's reach at most)."""

    start: int
    end: int
    seq_lens: tuple[int, ...]
    keys_before: int

    @property
    def key_start(self) -> int:
        return self.start - self.keys_before

    def causal_scores(self, sliding_window: int | None = None) -> float:
        """Query-key pairs its causal attention computes (the work it costs)."""
        total = 0.0
        for i, n in enumerate(self.seq_lens):
            before = self.keys_before if i == 0 else 0
            if sliding_window is None:
                total += n * (before + (n + 1) / 2)
            else:  # query j reads min(window, before + j + 1) keys
                full = max(0, min(n, sliding_window - before))
                total += full * (before + (full + 1) / 2) + (n - full) * sliding_window
        return total


def query_stretch(metadata: PackedRowMetadata, start: int, end: int, sliding_window: int | None = None) -> QueryStretch:
    """The documents' pieces of the global query stretch ``[start, end)`` of ``metadata``'s row."""
    if end <= start:
        return QueryStretch(start, end, (), 0)
    offsets = document_offsets(metadata.seq_lens)
    first, last = bisect.bisect_right(offsets, start) - 1, bisect.bisect_right(offsets, end - 1) - 1
    lens = tuple(min(offsets[i + 1], end) - max(offsets[i], start) for i in range(first, last + 1))
    keys_before = start - offsets[first]
    if sliding_window is not None:
        keys_before = min(keys_before, sliding_window - 1)
    return QueryStretch(start, end, lens, keys_before)


@functools.lru_cache(maxsize=8)
def document_offsets(seq_lens: tuple[int, ...]) -> tuple[int, ...]:
    """Each document's first token in the row, then the row's length (cached: every layer asks for the same row)."""
    return (0, *itertools.accumulate(seq_lens))


def key_range(metadata: PackedRowMetadata, sliding_window: int | None = None) -> tuple[int, int]:
    """Global ``[start, end)`` of the keys this rank's queries read: from the first local document's first token
    (or the window's reach into it) to the shard's end."""
    own = query_stretch(metadata, metadata.shard_start, metadata.shard_end, sliding_window)
    return own.key_start, own.end


SWAP_GAIN = 0.97
"""A pair swaps queries only when that cuts the busier rank's causal work below this fraction: a swap costs four
blocking exchanges per layer, not worth a few scores."""


def balanced_stretches(
    metadata: PackedRowMetadata, sliding_window: int | None = None, rank: int | None = None
) -> tuple[list[QueryStretch], int | None]:
    """The query stretches this rank (or rank ``rank`` of the same row) attends and the partner it swaps queries
    with (None: no swap).

    With a document spanning the row, later ranks' queries read more keys: the last rank computes ``2 - 1/cp``
    times the mean. Every rank holds the whole gathered row, so any rank can attend any queries: ranks ``r`` and
    ``cp - 1 - r`` swap the second halves of their shards when that cuts the busier one's work by more than 3 %
    (``SWAP_GAIN``). Then rank ``r`` attends chunks ``2r`` and ``2 cp - 1 - 2r`` of the row cut in ``2 cp`` (the
    zigzag split): equal work for one document, except a middle pair whose gain is under 3 % (busiest / mean 1.02
    at cp 64). Every rank decides from the same global metadata, so a pair always agrees and nobody else waits."""
    cp, local = metadata.cp_size, metadata.local_len
    rank = metadata.cp_rank if rank is None else rank
    if not 0 <= rank < cp:
        raise ContextParallelError(f"rank {rank} is outside [0, {cp})")
    partner, half = cp - 1 - rank, local // 2

    def stretches(of: int, swapped: bool) -> list[QueryStretch]:
        first, last = of * local, (of + 1) * local
        if not swapped:
            return [query_stretch(metadata, first, last, sliding_window)]
        other = (cp - 1 - of) * local
        return [
            query_stretch(metadata, first, first + half, sliding_window),
            query_stretch(metadata, other + half, other + local, sliding_window),
        ]

    whole = stretches(rank, False)
    if partner == rank or half == 0:
        return whole, None

    def busiest(swapped: bool) -> float:
        return max(sum(s.causal_scores(sliding_window) for s in stretches(r, swapped)) for r in (rank, partner))

    if busiest(True) < SWAP_GAIN * busiest(False):
        return stretches(rank, True), partner
    return whole, None


def stretch_bounds(stretch: QueryStretch) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``cu_q`` and ``cu_k`` of a stretch as host ints: its pieces' offsets, and the keys' (the first piece's keys
    begin ``keys_before`` earlier)."""
    cu_q = tuple(itertools.accumulate(stretch.seq_lens, initial=0))
    return cu_q, (0, *(end + stretch.keys_before for end in cu_q[1:]))


def _attend_stretch(
    q, keys, values, stretch: QueryStretch, scale, sliding_window, backend, row: RowBounds | None = None
) -> torch.Tensor:
    """``q`` ([stretch tokens, Hq, D]) against its keys (per-KV-head views from ``stretch.key_start``): varlen
    attention whose key ranges end where the query ranges end (bottom-right alignment). ``row``: the row's kernel
    bounds, which copy each stretch's bounds to the device once per row (else once per call)."""
    bounds = stretch_bounds(stretch)
    if row is not None:
        cu_q, cu_k = (row.int32_table(b) for b in bounds)
    else:
        cu_q, cu_k = (torch.tensor(b, dtype=torch.int32).to(q.device, non_blocking=True) for b in bounds)
    max_q = max(stretch.seq_lens)
    max_k = max(max_q, stretch.seq_lens[0] + stretch.keys_before)
    # One call per query head against its KV head: flash-attn 2's backward under grouped-query attention would
    # write dk and dv for every query head over the whole key range ([keys, Hq, D] each) before summing them.
    group = q.size(1) // len(keys)
    kwargs = dict(scale=scale, sliding_window=sliding_window, backend=backend, cu_seqlens_k=cu_k, max_seqlen_k=max_k)
    outputs = [
        varlen_causal_attention(
            q[:, head : head + 1], keys[head // group], values[head // group], cu_q, max_q, **kwargs
        )
        for head in range(q.size(1))
    ]
    return torch.cat(outputs, dim=1)


def kv_gather_attention(
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
    """Causal varlen attention of this rank's queries against the gathered keys and values of the row.

    q [S/cp, Hq, D], k and v [S/cp, Hkv, D] (this rank's tokens); returns [S/cp, Hq, Dv], exactly the rows an
    unsharded run computes for these tokens. ``balance``: let rank pairs swap half their queries where that evens
    the causal work (:func:`balanced_stretches`). Without CP this is plain varlen attention over ``metadata``'s
    documents.
    """
    check_attention_shard(q, k, v, metadata, topology)
    if sliding_window is not None and sliding_window < 1:
        raise ContextParallelError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if not topology.enabled:
        return varlen_causal_attention(
            q, k, v, metadata.cu_seqlens, metadata.max_seqlen, scale=scale, sliding_window=sliding_window,
            backend=backend,
        )  # fmt: skip
    if balance:
        stretches, partner = balanced_stretches(metadata, sliding_window)
    else:
        stretches, partner = [query_stretch(metadata, metadata.shard_start, metadata.shard_end, sliding_window)], None
    half = metadata.local_len // 2
    q_send = q[half:] if partner is not None else None
    gathered = _GatherKeysValues.apply(
        k, v, q_send, topology, tuple((s.key_start, s.end) for s in stretches), partner
    )  # fmt: skip
    heads, per_range = k.size(1), 2 * k.size(1)
    queries = [q] if partner is None else [q[:half], gathered[-1]]
    outputs = []
    row = metadata.kernel_bounds(q.device)
    for index, (stretch, q_stretch) in enumerate(zip(stretches, queries, strict=True)):
        views = gathered[index * per_range : (index + 1) * per_range]
        outputs.append(
            _attend_stretch(q_stretch, views[:heads], views[heads:], stretch, scale, sliding_window, backend, row)
        )
    if partner is None:
        return outputs[0]
    # The partner's second half goes back to it; ours comes back from it.
    return torch.cat([outputs[0], _SwapWithPartner.apply(outputs[1], partner, topology)])


class _SwapWithPartner(torch.autograd.Function):
    """Exchange a tensor with the partner rank; backward exchanges the gradients back."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, partner: int, topology: CPTopology) -> torch.Tensor:
        ctx.partner, ctx.topology = partner, topology
        return exchange_p2p(tensor, tensor.shape, partner, partner, topology)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return exchange_p2p(grad, grad.shape, ctx.partner, ctx.partner, ctx.topology), None, None
