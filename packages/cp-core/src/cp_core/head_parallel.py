"""Head-parallel (all-to-all) CP for recurrent layers whose heads share grouped inputs (Mamba-2 B/C groups).

The Ulysses idea applied to a recurrence: each rank holds ``[S/cp, ...]`` of every head; one all-to-all gives it
``[S, ...]`` of ``H/cp`` heads, the layer runs unsharded on the full row for those heads, and
:func:`cp_core.heads_to_sequence` brings the output back. Heads go to ranks in contiguous blocks (rank ``r`` holds
heads ``[r H/cp, (r+1) H/cp)``), like the query heads of :mod:`cp_core.ulysses`.

Grouped inputs (``G`` groups, head ``h`` reads group ``h // (H/G)``) follow the same rule as GQA's KV heads:
with ``cp | G`` rank ``r`` gets groups ``[r G/cp, (r+1) G/cp)``; with ``G | cp`` each group is repeated ``cp/G``
times before the exchange (:func:`cp_core.replicate_kv_heads`, whose autograd sums the replicas' gradients), so
rank ``r`` gets group ``r G // cp``, the one all its heads read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cp_core.errors import ContextParallelError
from cp_core.topology import CPTopology
from cp_core.ulysses import replicate_kv_heads, sequence_to_heads


def check_head_parallel(num_heads: int, num_groups: int, cp_size: int, what: str = "head-parallel CP") -> None:
    """Raise unless ``num_heads`` heads over ``num_groups`` groups split over ``cp_size`` ranks.

    Rules: cp | heads, G | heads, and cp | G (groups split) or G | cp (groups replicated).
    """
    if num_heads % num_groups:
        raise ContextParallelError(f"{what}: heads={num_heads} is not a multiple of groups={num_groups}")
    if cp_size == 1:
        return
    if num_heads % cp_size:
        raise ContextParallelError(
            f"{what} needs cp to divide the heads: cp={cp_size}, heads={num_heads}; choose cp in "
            f"{[d for d in range(1, num_heads + 1) if num_heads % d == 0]}"
        )
    if num_groups % cp_size and cp_size % num_groups:
        raise ContextParallelError(
            f"{what} needs cp | groups or groups | cp (groups are then replicated): cp={cp_size}, groups={num_groups}"
        )


def local_heads(num_heads: int, topology: CPTopology) -> slice:
    """The heads this rank holds in head-parallel layout."""
    per_rank = num_heads // topology.size
    return slice(topology.rank * per_rank, (topology.rank + 1) * per_rank)


def local_groups(num_groups: int, topology: CPTopology) -> slice:
    """The groups this rank holds in head-parallel layout (one replicated group when groups < cp)."""
    if num_groups < topology.size:
        group = topology.rank * num_groups // topology.size
        return slice(group, group + 1)
    per_rank = num_groups // topology.size
    return slice(topology.rank * per_rank, (topology.rank + 1) * per_rank)


def fused_sequence_to_heads(
    tensors: Sequence[torch.Tensor], topology: CPTopology, replicate: Sequence[bool] | None = None
) -> list[torch.Tensor]:
    """Exchange several ``[S/cp, H_i, D_i]`` tensors to ``[S, H_i/cp, D_i]`` (or ``[S, max(H_i, cp)/cp, D_i]``
    where ``replicate[i]`` asks for heads fewer than cp to be repeated first) in one all-to-all.

    Each rank's share of every tensor is flattened and concatenated, so the tensors travel together whatever
    their head counts and dims (same bytes as separate exchanges, one collective launch). Tensors of different
    dtypes are exchanged one by one. Gradients flow back through the same all-to-all.
    """
    replicate = list(replicate) if replicate is not None else [False] * len(tensors)
    if len(replicate) != len(tensors):
        raise ContextParallelError(f"replicate has {len(replicate)} flags for {len(tensors)} tensors")
    tensors = [replicate_kv_heads(t, topology.size) if rep else t for t, rep in zip(tensors, replicate, strict=True)]
    if not topology.enabled:
        return list(tensors)
    cp = topology.size
    s_local = tensors[0].size(0)
    for t in tensors:
        if t.dim() != 3 or t.size(0) != s_local or t.size(1) % cp:
            raise ContextParallelError(
                f"tensors must be [{s_local} local tokens, heads divisible by cp={cp}, dim]; got {tuple(t.shape)}"
            )
    if len({t.dtype for t in tensors}) > 1:
        return [sequence_to_heads(t, topology) for t in tensors]
    # [S/cp, cp, H_i/cp * D_i] per tensor: the leading cp-slot is the destination rank.
    parts = [t.reshape(s_local, cp, -1) for t in tensors]
    widths = [p.size(2) for p in parts]
    packed = torch.cat(parts, dim=2)  # [S/cp, cp, K]
    full = sequence_to_heads(packed.reshape(s_local, cp * sum(widths), 1), topology)  # [S, K, 1]
    pieces = full.squeeze(-1).split(widths, dim=1)
    return [p.reshape(cp * s_local, t.size(1) // cp, t.size(2)) for p, t in zip(pieces, tensors, strict=True)]
