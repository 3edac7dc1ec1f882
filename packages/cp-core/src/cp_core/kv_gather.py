"""All-gather-KV context parallelism for attention: any cp, whatever the head counts.

Each rank keeps its own queries ``[S / cp, Hq, D]`` and gathers the keys and values of the whole row (one
all-gather of ``[S / cp, 2 Hkv, D]`` forward, a reduce-scatter of their gradients backward). Each of the rank's
documents then attends its local queries against the document's keys from its first token, wherever that lies,
up to the rank's last token: varlen attention whose key ranges end where the query ranges end (bottom-right causal
alignment, see :mod:`cp_core.attention`). Nothing else changes, so it is exact like Ulysses.

Against Ulysses (:mod:`cp_core.ulysses`), which needs cp to divide the query heads:

- any cp, e.g. cp = 16 .. 64 for a model with 8 query heads;
- a rank sends its ``S / cp`` tokens' K and V to every other rank, ``2 Hkv D (cp - 1) S / cp`` elements forward
  and as many gradients backward, where Ulysses sends ``(cp - 1) / cp`` of its tokens' q, k, v and output,
  ``(2 Hq + 2 max(Hkv, cp)) D S / cp`` elements each way: fewer bytes while ``Hkv cp < Hq + max(Hkv, cp)``
  (grouped-query models at small cp), more beyond;
- the gathered keys of a rank's first document (up to the whole row on the last rank) stay alive for backward;
  attention runs one query head per call, so no kernel expands the key gradients to the query heads;
- the work is uneven: with one document over the row, rank ``r`` computes ``(r + 1/2) (S / cp)^2`` scores, the
  last rank ``2 - 1/cp`` times the mean (Ulysses splits the work evenly by heads).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from cp_core.attention import AttentionBackend, check_attention_shard, varlen_causal_attention
from cp_core.errors import ContextParallelError
from cp_core.packing import PackedRowMetadata
from cp_core.sharding import gather_sequence
from cp_core.topology import CPTopology
from cp_core.ulysses import check_ulysses_heads, ulysses_attention


class _GatherKeysValues(torch.autograd.Function):
    """All-gather the row's ``k|v`` and return the keys ``[start, end)`` of each KV head as its own output, a
    ``[end - start, 1, D]`` view of the one gathered buffer (k heads, then v heads).

    Separate outputs get their gradients separately (no row-sized zero-filled gradient per slice, as slicing under
    autograd would make); backward writes them all into one zeroed ``[S, 2 Hkv, D]`` buffer and reduce-scatters it."""

    @staticmethod
    def forward(ctx, k: torch.Tensor, v: torch.Tensor, topology: CPTopology, start: int, end: int):
        ctx.topology, ctx.start, ctx.end, ctx.local_len = topology, start, end, k.size(0)
        ctx.set_materialize_grads(False)  # an unused head's gradient stays None rather than a zero tensor
        local = torch.cat([k, v], dim=1)
        row = local.new_empty((topology.size * local.size(0), *local.shape[1:]))
        dist.all_gather_into_tensor(row, local, group=topology.group)
        keys = row[start:end]
        return tuple(keys[:, i : i + 1] for i in range(keys.size(1)))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        topology: CPTopology = ctx.topology
        like = next(g for g in grads if g is not None)
        row = like.new_zeros((topology.size * ctx.local_len, len(grads), like.size(2)))
        for i, grad in enumerate(grads):
            if grad is not None:
                row[ctx.start : ctx.end, i : i + 1] = grad
        local = row.new_empty((ctx.local_len, *row.shape[1:]))
        dist.reduce_scatter_tensor(local, row, op=dist.ReduceOp.SUM, group=topology.group)
        heads = len(grads) // 2
        return local[:, :heads], local[:, heads:], None, None, None


def gather_kv(
    k: torch.Tensor, v: torch.Tensor, topology: CPTopology, start: int = 0, end: int | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Keys and values ``[start, end)`` of the whole row (default: all of it), one ``[end - start, 1, D]`` tensor per
    KV head, from every rank's ``[S / cp, Hkv, D]`` shards: one all-gather when they share head dim and dtype;
    backward sums every rank's gradient into each shard (a reduce-scatter)."""
    end = topology.size * k.size(0) if end is None else end
    heads = k.size(1)
    if k.size(2) == v.size(2) and k.dtype == v.dtype:
        both = _GatherKeysValues.apply(k, v, topology, start, end)
        return list(both[:heads]), list(both[heads:])
    full_k = gather_sequence(k, topology, dim=0, backward="sum")[start:end]
    full_v = gather_sequence(v, topology, dim=0, backward="sum")[start:end]
    return [full_k[:, i : i + 1] for i in range(heads)], [full_v[:, i : i + 1] for i in range(heads)]


def key_range(metadata: PackedRowMetadata, sliding_window: int | None = None) -> tuple[int, int]:
    """Global ``[start, end)`` of the keys this rank's queries read: from the first local document's first token
    (or the window's reach into it) to the shard's end."""
    before = metadata.first_doc_tokens_before
    if sliding_window is not None:
        before = min(before, sliding_window - 1)
    return metadata.shard_start - before, metadata.shard_end


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
) -> torch.Tensor:
    """Causal varlen attention of this rank's queries against the gathered keys and values of the row.

    q [S/cp, Hq, D], k and v [S/cp, Hkv, D] (this rank's tokens); returns [S/cp, Hq, Dv], exactly the rows an
    unsharded run computes for these tokens. Without CP this is plain varlen attention over ``metadata``'s
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
    start, end = key_range(metadata, sliding_window)
    keys, values = gather_kv(k, v, topology, start, end)
    before = metadata.shard_start - start  # keys of the first local document that other ranks hold
    cu_q = metadata.local_cu_seqlens.to(device=q.device, dtype=torch.int32)  # once, not once per head
    cu_k = cu_q + torch.cat([cu_q.new_zeros(1), cu_q.new_full((cu_q.numel() - 1,), before)])
    max_k = max(metadata.local_max_seqlen, metadata.local_seq_lens[0] + before)
    # One call per query head against its KV head: flash-attn 2's backward under grouped-query attention would
    # write dk and dv for every query head over the whole key range ([keys, Hq, D] each) before summing them.
    group = q.size(1) // k.size(1)
    outputs = [
        varlen_causal_attention(
            q[:, head : head + 1],
            keys[head // group],
            values[head // group],
            cu_q,
            metadata.local_max_seqlen,
            scale=scale,
            sliding_window=sliding_window,
            backend=backend,
            cu_seqlens_k=cu_k,
            max_seqlen_k=max_k,
        )
        for head in range(q.size(1))
    ]
    return torch.cat(outputs, dim=1)


AttentionCPStyle = Literal["auto", "ulysses", "kv_gather"]
ATTENTION_CP_STYLES: tuple[str, ...] = ("auto", "ulysses", "kv_gather")


def resolve_attention_cp_style(style: str, num_q_heads: int, num_kv_heads: int, cp_size: int) -> str:
    """The concrete strategy, ``"ulysses"`` or ``"kv_gather"``, for these heads over ``cp_size`` ranks.

    ``"auto"`` takes Ulysses where its head rule holds (even work per rank) and all-gather KV otherwise; a forced
    ``"ulysses"`` raises the head rule's error, naming the way out."""
    if style not in ATTENTION_CP_STYLES:
        raise ContextParallelError(f"unknown attention CP style {style!r}; choose one of {ATTENTION_CP_STYLES}")
    if num_q_heads % num_kv_heads:
        raise ContextParallelError(f"q_heads={num_q_heads} is not a multiple of kv_heads={num_kv_heads}")
    if style == "kv_gather":
        return style
    try:
        check_ulysses_heads(num_q_heads, num_kv_heads, cp_size)
    except ContextParallelError as exc:
        if style == "ulysses":
            raise ContextParallelError(
                f"{exc}; or use attention CP style 'kv_gather' (or 'auto'), which takes any cp"
            ) from None
        return "kv_gather"
    return "ulysses"


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    metadata: PackedRowMetadata,
    topology: CPTopology,
    style: str,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    backend: AttentionBackend = "auto",
) -> torch.Tensor:
    """This rank's attention output under ``style`` ("ulysses" or "kv_gather"; resolve "auto" first with
    :func:`resolve_attention_cp_style`, once per model rather than per call)."""
    if style == "ulysses":
        attend = ulysses_attention
    elif style == "kv_gather":
        attend = kv_gather_attention
    else:
        raise ContextParallelError(f"attention CP style must be 'ulysses' or 'kv_gather' here, got {style!r}")
    return attend(q, k, v, metadata, topology, scale=scale, sliding_window=sliding_window, backend=backend)
