"""Document boundaries of one packed row in the forms the varlen kernels take, built once per row for all layers.

Every GDN, Mamba-2 and attention layer of a step reads the same boundaries. Built per call, each layer would copy a
fresh ``cu_seqlens`` from pageable host memory (CUDA waits for the stream to drain before such a copy) and fla,
whose caches key on tensor identity, would rebuild its chunk indices from it. Here they are built once, on the host,
and reach the device in one copy from pinned memory that does not wait for the stream:

- :class:`DocumentBounds`: one list of documents (the shard's clipped documents, or the whole row's): ``cu_seqlens``
  (int64 for fla, int32 for attention and mamba-ssm) on the device, its CPU copy, fla's chunk indices for its
  chunk of 64, mamba-ssm's per-token ``seq_idx`` and the longest document.
- :class:`RowBounds`: those of the shard and of the row on one device, plus a cache of the further tables layers of
  the same row ask for (a pre-pass segment's bounds, attention's query/key ranges). It is built by
  :meth:`cp_core.PackedRowMetadata.to` and travels inside the metadata, a forward argument of every layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch

FLA_CHUNK = 64
"""The chunk of fla's gated delta rule, simple GLA and causal conv1d kernels (their default): chunk indices are
built for it."""


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``: through pinned memory and without waiting for the stream on CUDA (a
    copy from pageable memory waits for all queued work first); ``host`` itself on the CPU."""
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


class _Memo:
    """Values built on first use and then kept. A plain object, not a dict or a dataclass: code that rebuilds
    forward arguments container by container (FSDP's input casting re-creates dataclasses and dicts) passes it on as
    it is, so every copy of a row's metadata shares what the first layer built."""

    def __init__(self) -> None:
        self._values: dict = {}

    def get(self, key, build: Callable[[], Any]) -> Any:
        if key not in self._values:
            self._values[key] = build()
        return self._values[key]


def chunk_indices_from_lens(seq_lens: Sequence[int], chunk_size: int = FLA_CHUNK) -> torch.Tensor:
    """int64 ``[chunks, 2]``: per chunk of ``chunk_size`` tokens (each document cut from its own first token), its
    document and its index inside the document (fla's ``prepare_chunk_indices`` layout)."""
    counts = torch.tensor([-(-n // chunk_size) for n in seq_lens], dtype=torch.int64)
    docs = torch.repeat_interleave(torch.arange(len(seq_lens), dtype=torch.int64), counts)
    first_chunk = torch.tensor([0, *accumulate(counts.tolist())][:-1], dtype=torch.int64)
    return torch.stack([docs, torch.arange(docs.numel(), dtype=torch.int64) - first_chunk[docs]], 1)


@dataclass(frozen=True)
class DocumentBounds:
    """Varlen-kernel arguments of one list of documents on one device (see the module docstring)."""

    seq_lens: tuple[int, ...]
    max_seqlen: int
    device: torch.device
    cu_seqlens_cpu: torch.Tensor
    """int64 [docs + 1] on the CPU (fla reads it there instead of from the device)."""
    cu_seqlens: torch.Tensor
    """int64 [docs + 1] on ``device`` (fla)."""
    cu_seqlens_int32: torch.Tensor
    """int32 [docs + 1] on ``device`` (varlen attention, flash-attn)."""
    chunk_indices: torch.Tensor
    """int64 [chunks, 2] on ``device``: fla's chunk indices for :data:`FLA_CHUNK`."""
    _memo: _Memo = field(default_factory=_Memo, compare=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens_cpu[-1])

    @property
    def seq_idx(self) -> torch.Tensor:
        """int32 [1, T] on ``device``: each token's document (mamba-ssm's and causal-conv1d's ``seq_idx``); built
        on first use, once."""

        def build() -> torch.Tensor:
            lens = torch.tensor(self.seq_lens, dtype=torch.int64)
            docs = torch.repeat_interleave(torch.arange(len(self.seq_lens), dtype=torch.int32), lens)
            return to_device(docs, self.device)[None]

        return self._memo.get("seq_idx", build)

    def fla_kwargs(self, chunk_indices: bool = True) -> dict[str, torch.Tensor]:
        """fla's varlen arguments: ``cu_seqlens``, its CPU copy and (for the kernels that take them) the chunk
        indices, so fla neither reads the device nor rebuilds them."""
        kwargs = {"cu_seqlens": self.cu_seqlens, "cu_seqlens_cpu": self.cu_seqlens_cpu}
        if chunk_indices:
            kwargs["chunk_indices"] = self.chunk_indices
        return kwargs


def build_document_bounds(seq_lens: Sequence[int], device: torch.device | str) -> DocumentBounds:
    """:class:`DocumentBounds` of documents ``seq_lens`` (positive ints) on ``device``: computed on the host, then
    one copy to the device."""
    lens = tuple(int(n) for n in seq_lens)
    cu = torch.tensor([0, *accumulate(lens)], dtype=torch.int64)
    chunks = chunk_indices_from_lens(lens)
    flat = to_device(torch.cat([cu, chunks.reshape(-1)]), device)  # one copy for both
    cu_device, chunks_device = flat[: cu.numel()], flat[cu.numel() :].view(-1, 2)
    return DocumentBounds(
        seq_lens=lens,
        max_seqlen=max(lens),
        device=flat.device,
        cu_seqlens_cpu=cu,
        cu_seqlens=cu_device,
        cu_seqlens_int32=cu_device.to(torch.int32),
        chunk_indices=chunks_device,
    )


@dataclass(frozen=True)
class RowBounds:
    """One packed row's :class:`DocumentBounds` on one device: ``local`` (the documents clipped to this rank's
    shard) and ``row`` (the whole row's; the same object without CP), and a per-row cache of further tables."""

    local: DocumentBounds
    row: DocumentBounds
    _cache: _Memo = field(default_factory=_Memo, compare=False, repr=False)

    @property
    def device(self) -> torch.device:
        return self.local.device

    def for_lens(self, seq_lens: Sequence[int]) -> DocumentBounds:
        """Bounds of another list of documents of this row (e.g. a pre-pass segment), built once per row."""
        lens = tuple(seq_lens)
        if lens == self.local.seq_lens:
            return self.local
        if lens == self.row.seq_lens:
            return self.row
        return self._cache.get(("bounds", lens), lambda: build_document_bounds(lens, self.device))

    def int32_table(self, values: Sequence[int]) -> torch.Tensor:
        """``values`` as an int32 tensor on the device (attention's per-stretch ``cu_q`` / ``cu_k``), copied once
        per row."""
        values = tuple(values)
        return self._cache.get(
            ("int32", values), lambda: to_device(torch.tensor(values, dtype=torch.int32), self.device)
        )


def build_row_bounds(local_seq_lens: Sequence[int], seq_lens: Sequence[int], device: torch.device | str) -> RowBounds:
    """:class:`RowBounds` of a row of documents ``seq_lens`` whose shard holds ``local_seq_lens`` (equal without
    CP: then one set of bounds serves both)."""
    local = build_document_bounds(local_seq_lens, device)
    row = local if tuple(seq_lens) == local.seq_lens else build_document_bounds(seq_lens, device)
    return RowBounds(local=local, row=row)
