"""Ulysses (all-to-all) sequence parallelism for attention.

Each rank holds ``[S / cp, H, D]``. One all-to-all turns that into ``[S, H / cp, D]`` (the full sequence for
a slice of heads), attention runs over the whole packed row with the global document boundaries, and a
second all-to-all returns ``[S / cp, H, D]``. Query heads go to ranks in contiguous groups, so rank ``r``
holds query heads ``[r * Hq / cp, (r + 1) * Hq / cp)``; with grouped-query attention those need KV head
``r * Hkv // cp``. When ``Hkv < cp`` each KV head is repeated ``cp / Hkv`` times before the exchange; the
autograd of that repeat sums the replicas' gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cp_core.errors import ContextParallelError
from cp_core.packing import PackedRowMetadata
from cp_core.topology import CPTopology
from cp_core.varlen_attention import AttentionBackend, check_attention_shard, varlen_causal_attention


def check_ulysses_heads(num_q_heads: int, num_kv_heads: int, cp_size: int) -> None:
    """Raise unless Ulysses can split these heads over ``cp_size`` ranks.

    Rules: cp | q_heads, and either cp | kv_heads or kv_heads | cp (then KV heads are replicated).
    """
    if cp_size == 1:
        return
    if num_q_heads % cp_size:
        raise ContextParallelError(
            f"Ulysses attention needs cp to divide the query heads: cp={cp_size}, q_heads={num_q_heads}; "
            f"choose cp in {[d for d in range(1, num_q_heads + 1) if num_q_heads % d == 0]}"
        )
    if num_q_heads % num_kv_heads:
        raise ContextParallelError(f"q_heads={num_q_heads} is not a multiple of kv_heads={num_kv_heads}")
    if num_kv_heads % cp_size and cp_size % num_kv_heads:
        raise ContextParallelError(
            f"Ulysses attention needs cp | kv_heads or kv_heads | cp (KV heads are then replicated): "
            f"cp={cp_size}, kv_heads={num_kv_heads}"
        )


def replicate_kv_heads(x: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Repeat each KV head ``cp / Hkv`` times when ``Hkv < cp`` (x: [S, Hkv, D]); a no-op otherwise."""
    heads = x.size(1)
    if heads >= cp_size:
        return x
    return x.repeat_interleave(cp_size // heads, dim=1)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over dim 0 of a [cp, ...] tensor; its own adjoint, so backward is the same."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()  # before empty_like, which would copy a transposed input's strides
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def _exchange(x: torch.Tensor, topology: CPTopology) -> torch.Tensor:
    return _AllToAll.apply(x, topology.group)


def sequence_to_heads(x: torch.Tensor, topology: CPTopology) -> torch.Tensor:
    """[S / cp, H, D] -> [S, H / cp, D] (cp must divide H)."""
    if not topology.enabled:
        return x
    cp = topology.size
    s_local, heads, dim = x.shape
    if heads % cp:
        raise ContextParallelError(f"cannot split {heads} heads over cp={cp} ranks")
    chunks = x.reshape(s_local, cp, heads // cp, dim).transpose(0, 1)  # [cp, S/cp, H/cp, D]
    return _exchange(chunks, topology).reshape(cp * s_local, heads // cp, dim)


def heads_to_sequence(x: torch.Tensor, topology: CPTopology) -> torch.Tensor:
    """[S, H / cp, D] -> [S / cp, H, D], the inverse of :func:`sequence_to_heads`."""
    if not topology.enabled:
        return x
    cp = topology.size
    seq, heads, dim = x.shape
    if seq % cp:
        raise ContextParallelError(f"cannot split {seq} tokens over cp={cp} ranks")
    received = _exchange(x.reshape(cp, seq // cp, heads, dim), topology)  # [cp (head group), S/cp, H/cp, D]
    return received.transpose(0, 1).reshape(seq // cp, cp * heads, dim)


def qkv_sequence_to_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topology: CPTopology
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exchange q [S/cp, Hq, D] and k, v [S/cp, Hkv, D] to head-sharded full-sequence tensors.

    KV heads are replicated first when Hkv < cp. When all three share head dim and dtype they travel in
    one all-to-all (one collective launch instead of three, same bytes).
    """
    if not topology.enabled:
        return q, k, v
    cp = topology.size
    check_ulysses_heads(q.size(1), k.size(1), cp)
    k, v = replicate_kv_heads(k, cp), replicate_kv_heads(v, cp)
    if not (q.size(2) == k.size(2) == v.size(2) and q.dtype == k.dtype == v.dtype):
        return sequence_to_heads(q, topology), sequence_to_heads(k, topology), sequence_to_heads(v, topology)
    s_local, dim = q.size(0), q.size(2)
    hq, hk = q.size(1) // cp, k.size(1) // cp
    packed = torch.cat(
        [q.reshape(s_local, cp, hq, dim), k.reshape(s_local, cp, hk, dim), v.reshape(s_local, cp, hk, dim)],
        dim=2,
    ).transpose(0, 1)  # [cp, S/cp, hq + 2 hk, D]
    full = _exchange(packed, topology).reshape(cp * s_local, hq + 2 * hk, dim)
    return full[:, :hq], full[:, hq : hq + hk], full[:, hq + hk :]


def ulysses_attention(
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
    """Causal varlen attention of this rank's shard against the whole packed row.

    q [S/cp, Hq, D], k and v [S/cp, Hkv, D] (this rank's tokens); returns [S/cp, Hq, Dv]. Without CP this is
    plain varlen attention over ``metadata``'s documents.
    """
    check_attention_shard(q, k, v, metadata, topology)
    check_ulysses_heads(q.size(1), k.size(1), topology.size)
    qh, kh, vh = qkv_sequence_to_heads(q, k, v, topology)
    out = varlen_causal_attention(
        qh,
        kh,
        vh,
        metadata.cu_seqlens,
        metadata.max_seqlen,
        scale=scale,
        sliding_window=sliding_window,
        backend=backend,
    )
    return heads_to_sequence(out, topology)
