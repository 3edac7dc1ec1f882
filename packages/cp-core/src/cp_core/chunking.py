"""Document-aligned chunk layout for chunked recurrences over packed documents.

Every document is cut into chunks of ``chunk_size`` tokens starting at its own first token (its last chunk is
padded), so no chunk ever holds two documents: intra-chunk math needs no reset masks, and the state resets exactly
at chunks that start a document. Padding adds at most ``chunk_size - 1`` slots per document.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChunkLayout:
    chunk_size: int
    num_tokens: int
    token_index: torch.Tensor
    """[num_chunks, chunk_size] token index of each slot; padding slots point at ``num_tokens`` (a zero row)."""
    valid: torch.Tensor
    """[num_chunks, chunk_size] bool, False on padding slots."""
    chunk_starts_doc: tuple[bool, ...]
    chunk_doc: tuple[int, ...]
    """Local document index of each chunk."""
    doc_last_chunk: tuple[int, ...]

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_doc)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [num_chunks, chunk_size, ...] with zeros on padding slots."""
        padded = torch.cat([x, x.new_zeros((1, *x.shape[1:]))], dim=0)
        return padded[self.token_index.to(x.device)]

    def scatter(self, chunks: torch.Tensor) -> torch.Tensor:
        """[num_chunks, chunk_size, ...] -> [T, ...], dropping padding slots."""
        flat = chunks.reshape(-1, *chunks.shape[2:])
        return flat[self.valid.reshape(-1).to(chunks.device)]


def build_chunk_layout(seq_lens: Sequence[int], chunk_size: int) -> ChunkLayout:
    """Layout of documents ``seq_lens`` (local, in order) in chunks of ``chunk_size``."""
    total = sum(seq_lens)
    rows: list[torch.Tensor] = []
    starts: list[bool] = []
    docs: list[int] = []
    last: list[int] = []
    offset = 0
    for doc, length in enumerate(seq_lens):
        n = -(-length // chunk_size)
        idx = torch.arange(n * chunk_size) + offset
        idx[length:] = total
        rows.append(idx.view(n, chunk_size))
        starts += [True] + [False] * (n - 1)
        docs += [doc] * n
        last.append(len(docs) - 1)
        offset += length
    index = torch.cat(rows) if rows else torch.empty(0, chunk_size, dtype=torch.long)
    return ChunkLayout(chunk_size, total, index, index < total, tuple(starts), tuple(docs), tuple(last))
