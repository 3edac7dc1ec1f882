"""Softmax attention under CP: the three strategies behind one call, and the choice between them.

- ``"ulysses"`` (:mod:`cp_core.ulysses`): all-to-all over heads, even work; cp must divide the query heads.
- ``"kv_gather"`` (:mod:`cp_core.kv_gather`): every rank all-gathers the row's keys and values; any cp, the
  fewest collectives, but the whole row's keys and values (and their gradient buffer) live on every rank.
- ``"kv_ring"`` (:mod:`cp_core.kv_ring`): the keys and values pass around the ring; any cp, memory that does not
  grow with the row, twice all-gather KV's bytes in backward.
- ``"auto"``: Ulysses where its head rule holds; otherwise all-gather KV below ``AUTO_RING_FROM_CP`` ranks and the
  ring from there.
"""

from __future__ import annotations

from typing import Literal

import torch

from cp_core.errors import ContextParallelError
from cp_core.kv_gather import kv_gather_attention
from cp_core.kv_ring import kv_ring_attention
from cp_core.packing import PackedRowMetadata
from cp_core.topology import CPTopology
from cp_core.ulysses import check_ulysses_heads, ulysses_attention
from cp_core.varlen_attention import AttentionBackend

AttentionCPStyle = Literal["auto", "ulysses", "kv_gather", "kv_ring"]
ATTENTION_CP_STYLES: tuple[str, ...] = ("auto", "ulysses", "kv_gather", "kv_ring")
_RUNNERS = {"ulysses": ulysses_attention, "kv_gather": kv_gather_attention, "kv_ring": kv_ring_attention}
# Where "auto" leaves all-gathered KV for the ring. On one H200 (0.8B, 32k tokens a rank) both held
# 0.95x the ideal per-rank memory at cp 16, where the gather sends a quarter fewer bytes and balances documents that
# straddle one cut; at cp 32 / 64 the gathered row's keys and values took it to 1.26x / 1.63x, the ring stayed at
# 0.95x, and its compute was 1-3 % lower.
AUTO_RING_FROM_CP = 32


def resolve_attention_cp_style(style: str, num_q_heads: int, num_kv_heads: int, cp_size: int) -> str:
    """The concrete strategy, ``"ulysses"``, ``"kv_gather"`` or ``"kv_ring"``, for these heads over ``cp_size``
    ranks.

    ``"auto"`` takes Ulysses where its head rule holds (even work per rank); otherwise all-gather KV, or from
    ``AUTO_RING_FROM_CP`` ranks the ring, whose memory does not grow with the row. A forced ``"ulysses"`` raises
    the head rule's error, naming the way out."""
    if style not in ATTENTION_CP_STYLES:
        raise ContextParallelError(f"unknown attention CP style {style!r}; choose one of {ATTENTION_CP_STYLES}")
    if num_q_heads % num_kv_heads:
        raise ContextParallelError(f"q_heads={num_q_heads} is not a multiple of kv_heads={num_kv_heads}")
    if style in ("kv_gather", "kv_ring"):
        return style
    try:
        check_ulysses_heads(num_q_heads, num_kv_heads, cp_size)
    except ContextParallelError as exc:
        if style == "ulysses":
            raise ContextParallelError(
                f"{exc}; or use attention CP style 'kv_gather' or 'kv_ring' (or 'auto'), which take any cp"
            ) from None
        return "kv_ring" if cp_size >= AUTO_RING_FROM_CP else "kv_gather"
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
    """This rank's attention output under ``style`` ("ulysses", "kv_gather" or "kv_ring"; resolve "auto" first
    with :func:`resolve_attention_cp_style`, once per model rather than per call)."""
    attend = _RUNNERS.get(style)
    if attend is None:
        raise ContextParallelError(
            f"attention CP style must be one of {tuple(_RUNNERS)} here, got {style!r} (resolve 'auto' first)"
        )
    return attend(q, k, v, metadata, topology, scale=scale, sliding_window=sliding_window, backend=backend)
