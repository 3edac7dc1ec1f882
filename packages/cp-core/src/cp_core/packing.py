"""Packed-row metadata: global document lengths -> global and per-rank boundaries.

A packed row of ``S`` tokens holds documents of lengths ``seq_lens`` (global, summing to ``S``). Under CP
rank ``r`` holds tokens ``[r * S / cp, (r + 1) * S / cp)``; documents may straddle these cuts. Everything
here is computed on the host from Python integers, so building it never waits on a device.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from itertools import accumulate

import torch

from cp_core.document_bounds import RowBounds, build_row_bounds, to_device
from cp_core.errors import ContextParallelError

SeqLens = Sequence[int] | torch.Tensor


def normalize_seq_lens(seq_lens: SeqLens, total_len: int | None = None) -> tuple[int, ...]:
    """Validate document lengths of one packed row and return them as a tuple of ints."""
    if isinstance(seq_lens, torch.Tensor):
        if seq_lens.device.type != "cpu":
            raise ContextParallelError(
                f"seq_lens must live on the CPU (got a tensor on {seq_lens.device}); reading it from the "
                "device would synchronize every step. Keep the document lengths from the data loader on the host."
            )
        if seq_lens.dim() != 1 or seq_lens.is_floating_point() or seq_lens.is_complex() or seq_lens.dtype == torch.bool:
            raise ContextParallelError(
                f"seq_lens must be a 1-D integer tensor of document lengths, got shape {tuple(seq_lens.shape)} "
                f"and dtype {seq_lens.dtype}"
            )
        lens = tuple(int(x) for x in seq_lens.tolist())
    else:
        lens = tuple(seq_lens)
        for x in lens:
            if isinstance(x, bool) or not isinstance(x, int):
                raise ContextParallelError(
                    f"seq_lens must hold Python ints, got {x!r} of type {type(x).__name__} in seq_lens={list(lens)}"
                )
    if not lens:
        raise ContextParallelError("seq_lens is empty: a packed row needs at least one document")
    bad = [x for x in lens if x <= 0]
    if bad:
        raise ContextParallelError(f"every document length must be positive, got {bad[0]} in seq_lens={list(lens)}")
    if total_len is not None and sum(lens) != total_len:
        raise ContextParallelError(
            f"seq_lens sum to {sum(lens)} but the row has {total_len} tokens; the document lengths must cover "
            "the row exactly (give padding its own document)"
        )
    return lens


def check_divisible(total_len: int, cp_size: int, what: str = "row length") -> None:
    """Raise unless ``total_len`` splits evenly over ``cp_size`` ranks, naming the padding that fixes it."""
    if total_len % cp_size:
        pad = (-total_len) % cp_size
        raise ContextParallelError(
            f"{what} {total_len} is not divisible by cp={cp_size}; pad the row by {pad} token(s) "
            f"(to {total_len + pad}) as its own document, or choose a cp that divides {total_len}"
        )


def cu_seqlens_from_lens(lens: Sequence[int]) -> torch.Tensor:
    """Cumulative offsets ``[0, l0, l0 + l1, ...]`` as an int32 CPU tensor (the varlen-kernel convention)."""
    return torch.tensor([0, *accumulate(lens)], dtype=torch.int32)


def position_ids_from_seq_lens(seq_lens: SeqLens) -> torch.Tensor:
    """Positions that restart at 0 at every document start, [S] int64 on the CPU."""
    lens = normalize_seq_lens(seq_lens)
    starts = torch.tensor([0, *accumulate(lens)][:-1], dtype=torch.int64)
    total = sum(lens)
    return torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(starts, torch.tensor(lens))


@dataclass(frozen=True)
class PackedRowMetadata:
    """Boundaries of one packed row, globally and for one CP rank.

    Tensors live on the CPU unless moved with :meth:`to`; lengths and flags are Python values so that
    kernels and control flow never need a device read.
    """

    seq_lens: tuple[int, ...]
    """Global document lengths, summing to ``total_len``."""
    total_len: int
    cp_rank: int
    cp_size: int
    cu_seqlens: torch.Tensor
    """Global cumulative document offsets, int32 [num_docs + 1]."""
    max_seqlen: int
    shard_start: int
    shard_end: int
    local_seq_lens: tuple[int, ...]
    """Lengths of the documents clipped to this shard, in order."""
    local_cu_seqlens: torch.Tensor
    """Cumulative offsets of the clipped documents inside the shard, int32."""
    local_max_seqlen: int
    first_doc_index: int
    """Global index of the document holding the shard's first token."""
    first_doc_starts_before: bool
    """Whether that document began on an earlier rank."""
    first_doc_start_rank: int
    """Rank holding that document's first token (== cp_rank when it starts here)."""
    first_doc_tokens_before: int
    """How many of that document's tokens lie before this shard."""
    last_doc_continues: bool
    """Whether the shard's last document goes on into a later rank."""
    local_doc_ids: torch.Tensor
    """Global document index of each token of the shard, int32 [S_local]."""
    local_position_ids: torch.Tensor
    """Position of each token of the shard inside its document, int64 [S_local]."""
    doc_start_rank_by_rank: tuple[int, ...]
    """For every rank ``j``: the rank where rank ``j``'s first document began (needed to chain states)."""
    bounds: RowBounds | None = field(default=None, compare=False, repr=False)
    """The row's kernel boundaries on the device the metadata was moved to (:meth:`to`), shared by every layer."""

    @property
    def local_len(self) -> int:
        return self.shard_end - self.shard_start

    @property
    def num_docs(self) -> int:
        return len(self.seq_lens)

    @property
    def local_num_docs(self) -> int:
        return len(self.local_seq_lens)

    def to(self, device: torch.device | str) -> PackedRowMetadata:
        """Copy of this metadata with its tensors on ``device`` and the row's kernel boundaries built there
        (:class:`cp_core.document_bounds.RowBounds`): one call per row, host-to-device copies from pinned memory
        that do not wait for the stream."""
        bounds = build_row_bounds(self.local_seq_lens, self.seq_lens, device)
        return replace(
            self,
            cu_seqlens=bounds.row.cu_seqlens_int32,
            local_cu_seqlens=bounds.local.cu_seqlens_int32,
            local_doc_ids=to_device(self.local_doc_ids, device),
            local_position_ids=to_device(self.local_position_ids, device),
            bounds=bounds,
        )

    def kernel_bounds(self, device: torch.device | str) -> RowBounds:
        """The row's kernel boundaries on ``device``: those built by :meth:`to` when they are there, else built now
        (for direct callers that pass host metadata; a layer of a model always finds them built)."""
        device = torch.device(device)
        if self.bounds is not None and _same_device(self.bounds.device, device):
            return self.bounds
        return build_row_bounds(self.local_seq_lens, self.seq_lens, device)


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:<current>`` name the same device."""
    if a.type != b.type:
        return False
    if a.index is None or b.index is None:
        current = torch.cuda.current_device() if a.type == "cuda" else 0
        return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
    return a.index == b.index


def build_packed_metadata(
    seq_lens: SeqLens, cp_rank: int = 0, cp_size: int = 1, total_len: int | None = None
) -> PackedRowMetadata:
    """Metadata of one packed row for rank ``cp_rank`` of ``cp_size``.

    ``total_len`` (the row length), when given, must equal ``sum(seq_lens)``; it must be divisible by
    ``cp_size``. Raises :class:`ContextParallelError` naming the offending value otherwise.
    """
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ContextParallelError(f"invalid CP rank {cp_rank} for cp={cp_size}")
    lens = normalize_seq_lens(seq_lens, total_len)
    total = sum(lens)
    check_divisible(total, cp_size)
    offsets = [0, *accumulate(lens)]
    local = total // cp_size

    def doc_at(token: int) -> int:
        # Index of the document holding `token`: the last start <= token.
        return bisect.bisect_right(offsets, token) - 1

    def start_rank(rank: int) -> int:
        return offsets[doc_at(rank * local)] // local

    start, end = cp_rank * local, (cp_rank + 1) * local
    first, last = doc_at(start), doc_at(end - 1)
    local_lens = tuple(min(offsets[d + 1], end) - max(offsets[d], start) for d in range(first, last + 1))
    doc_ids = torch.repeat_interleave(
        torch.arange(first, last + 1, dtype=torch.int32), torch.tensor(local_lens, dtype=torch.int64)
    )
    doc_starts = torch.tensor(offsets, dtype=torch.int64)[doc_ids.long()]
    positions = torch.arange(start, end, dtype=torch.int64) - doc_starts
    return PackedRowMetadata(
        seq_lens=lens,
        total_len=total,
        cp_rank=cp_rank,
        cp_size=cp_size,
        cu_seqlens=torch.tensor(offsets, dtype=torch.int32),
        max_seqlen=max(lens),
        shard_start=start,
        shard_end=end,
        local_seq_lens=local_lens,
        local_cu_seqlens=cu_seqlens_from_lens(local_lens),
        local_max_seqlen=max(local_lens),
        first_doc_index=first,
        first_doc_starts_before=offsets[first] < start,
        first_doc_start_rank=offsets[first] // local,
        first_doc_tokens_before=start - offsets[first],
        last_doc_continues=offsets[last + 1] > end,
        local_doc_ids=doc_ids,
        local_position_ids=positions,
        doc_start_rank_by_rank=tuple(start_rank(r) for r in range(cp_size)),
    )
