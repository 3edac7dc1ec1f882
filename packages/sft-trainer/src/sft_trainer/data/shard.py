"""One chunk's shard of the token store (:mod:`sft_trainer.data.tokenize`), filled a document at a time.

Text documents come as their pieces' id lists and loss flags: the ids are converted to int32 once per batch of
documents and the mask is written a piece at a time, so no Python work is done per token beyond the tokenizer's
own id lists. Documents with images come as a :class:`~sft_trainer.data.chat.TokenizedConversation`.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from sft_trainer.data.chat import TokenizedConversation

_FLAG_BYTES = (b"\x00", b"\x01")


def image_reference(image: Any, base_dir: Path) -> tuple[int, bytes, tuple[int, int]]:
    """``(kind, payload, (size, mtime_ns))`` of an image part's value: kind 0 a path or data URI kept as written
    (read later with the same rules, relative to ``base_dir``), kind 1 raw bytes; the stat of a path's file lets
    a row detect an image changed after the store was built."""
    if isinstance(image, Mapping):
        image = image.get("bytes") or image.get("path")
    if isinstance(image, bytes):
        return 1, image, (-1, -1)
    stat = (-1, -1)
    if not image.startswith("data:"):
        path = Path(image.removeprefix("file://"))
        path = path if path.is_absolute() else base_dir / path
        with_stat = path.stat()
        stat = (with_stat.st_size, with_stat.st_mtime_ns)
    return 0, image.encode("utf-8"), stat


class Shard:
    """The arrays of one chunk's documents, in the order they are added; :meth:`save` writes them as one ``.npz``
    (the names :func:`sft_trainer.data.tokenize._merge` reads)."""

    def __init__(self) -> None:
        self._token_parts: list[np.ndarray] = []
        self._pending: list[list[int]] = []  # id lists not yet in _token_parts
        self._pending_tokens = 0
        self.tokens = 0
        self.mask = bytearray()
        self.doc_lens, self.doc_rows, self.doc_loss, self.doc_images = array("q"), array("q"), array("q"), array("q")
        self.spans, self.grids, self.stats, self.ref_lens = array("i"), array("q"), array("q"), array("q")
        self.kinds = array("B")
        self.refs = bytearray()

    @property
    def documents(self) -> int:
        return len(self.doc_lens)

    @property
    def images(self) -> int:
        return len(self.kinds)

    def add_text(self, row: int, encoded: list[list[int]], flags: list[int]) -> None:
        """A document without images: its pieces' ids back to back, each token flagged as its piece."""
        length = loss = 0
        first = None  # the first token's flag: the stored loss count leaves it out (a label is the next token)
        for piece_ids, flag in zip(encoded, flags, strict=True):
            n = len(piece_ids)
            if not n:
                continue
            if first is None:
                first = flag
            self._pending.append(piece_ids)
            self.mask += _FLAG_BYTES[flag] * n
            length += n
            loss += flag * n
        self._pending_tokens += length
        self._add_doc(row, length, loss - (first or 0), 0)

    def add_document(self, row: int, doc: TokenizedConversation, images: list[tuple[int, bytes, Any]]) -> None:
        """A document with images: ``images`` are the ``(kind, payload, (size, mtime_ns))`` references of its
        image parts, in order (:func:`image_reference`)."""
        self._pending.append(doc.input_ids)
        self._pending_tokens += len(doc.input_ids)
        self.mask += bytes(doc.loss_mask)
        with_images = doc.image_grid_thw is not None
        self._add_doc(row, len(doc.input_ids), sum(doc.loss_mask[1:]), len(images) if with_images else 0)
        if not with_images:
            return
        for (start, end), grid, (kind, payload, stat) in zip(
            doc.image_spans, doc.image_grid_thw.tolist(), images, strict=True
        ):
            self.spans.extend((start, end))
            self.grids.extend(grid)
            self.stats.extend(stat)
            self.kinds.append(kind)
            self.ref_lens.append(len(payload))
            self.refs += payload

    def _add_doc(self, row: int, length: int, loss: int, images: int) -> None:
        self.tokens += length
        self.doc_lens.append(length)
        self.doc_rows.append(row)
        self.doc_loss.append(loss)
        self.doc_images.append(images)

    def convert(self) -> None:
        """Turn the id lists added so far into int32 (after each batch, so that their Python ints go)."""
        if self._pending:
            ids = itertools.chain.from_iterable(self._pending)
            self._token_parts.append(np.fromiter(ids, np.int32, self._pending_tokens))
            self._pending, self._pending_tokens = [], 0

    def save(self, path: Path) -> None:
        self.convert()
        np.savez(
            path,
            tokens=np.concatenate(self._token_parts) if self._token_parts else np.zeros(0, np.int32),
            loss_mask=np.frombuffer(self.mask, np.uint8),
            doc_lens=np.frombuffer(self.doc_lens, np.int64),
            doc_row=np.frombuffer(self.doc_rows, np.int64),
            doc_loss=np.frombuffer(self.doc_loss, np.int64),
            doc_images=np.frombuffer(self.doc_images, np.int64),
            image_spans=np.frombuffer(self.spans, np.int32).reshape(-1, 2),
            image_grid=np.frombuffer(self.grids, np.int64).reshape(-1, 3),
            image_stat=np.frombuffer(self.stats, np.int64).reshape(-1, 2),
            image_kind=np.frombuffer(self.kinds, np.uint8),
            ref_lens=np.frombuffer(self.ref_lens, np.int64),
            image_refs=np.frombuffer(bytes(self.refs), np.uint8),
        )
