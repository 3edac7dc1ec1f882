"""Ring attention's plan: which query rows meet which key rows of which block at each step, the same on every rank
(a pure function of the row's document lengths, cp and the rank)."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from cp_core.kv_gather import QueryStretch, balanced_stretches, query_stretch
from cp_core.packing import build_packed_metadata


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
