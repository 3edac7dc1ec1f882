"""Packed rows and greedy in-memory packing of tokenized conversations into rows of exactly ``seq_len``."""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import torch

from sft_trainer.data.chat import TokenizedConversation
from sft_trainer.data.conversations import IGNORE_INDEX, DataError, Overlong


@dataclass(frozen=True)
class PackedRow:
    """One packed row of exactly ``seq_len`` tokens (all on the CPU)."""

    input_ids: torch.Tensor
    """int64 [S]."""
    labels: torch.Tensor
    """int64 [S]: next-token targets within each document, -100 where there is no loss."""
    seq_lens: tuple[int, ...]
    """Document lengths summing to S; when ``padding > 0`` the last one is the padding document."""
    padding: int
    """Padding tokens at the end of the row (0 when the documents fill it)."""
    num_loss_tokens: int
    """Labels that are not -100."""
    pixel_values: torch.Tensor | None = None
    """float32 [patches, C * T * P * P]: the images of the row's documents, in document order; None without."""
    image_grid_thw: torch.Tensor | None = None
    """int64 [images, 3]: their patch grids, in the order of their pad runs in ``input_ids``; None without."""

    @property
    def num_documents(self) -> int:
        """Real documents in the row (padding excluded)."""
        return len(self.seq_lens) - (1 if self.padding else 0)

    _KEYS = ("input_ids", "labels", "seq_lens", "padding", "num_loss_tokens", "pixel_values", "image_grid_thw")

    def __getitem__(self, key: str) -> Any:
        """Mapping-style access, ``row["input_ids"]``, for loops written against dict rows."""
        if key not in self._KEYS:
            raise KeyError(key)
        return getattr(self, key)

    def keys(self) -> tuple[str, ...]:
        return self._KEYS

    def as_dict(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in self._KEYS}


@dataclass(frozen=True)
class PackStats:
    """What packing did; ``skipped_malformed`` is filled in by :meth:`PackedDataset.build`."""

    rows: int = 0
    documents: int = 0
    """Documents packed into rows (truncated ones included; padding excluded)."""
    truncated: int = 0
    dropped: int = 0
    """Documents longer than ``seq_len`` dropped (``overlong="drop"``)."""
    empty: int = 0
    """Documents of zero tokens, ignored."""
    skipped_malformed: int = 0
    loss_tokens: int = 0
    padding_tokens: int = 0
    no_loss_documents: int = 0
    """Packed documents without a single loss token (empty replies, or truncated before the first reply)."""

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def summary(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in asdict(self).items())

    __str__ = summary


def no_rows_error(stats: PackStats, seq_len: int, first_skipped: str | None = None) -> DataError:
    """The error of a packing that made no row, with why where the stats tell: every document dropped as too long,
    every row skipped as malformed (``first_skipped``: the first one's reason, where it was kept), or no tokens."""
    hint = ""
    if stats.dropped:
        hint = (
            f"; all {stats.dropped} document(s) were longer than data.seq_len={seq_len} and "
            "data.overlong='drop' dropped them: raise data.seq_len or set data.overlong='truncate'"
        )
    elif not stats.documents and stats.skipped_malformed:
        hint = (
            f"; every row was skipped as malformed (data.on_error='skip'), the first: {first_skipped}"
            if first_skipped is not None
            else "; every row was skipped as malformed (on_error='skip'): on_error='raise' names the first"
        )
    elif not stats.documents:
        hint = "; the data holds no conversation with any tokens"
    return DataError(f"no packed rows: nothing to train on ({stats.summary()}){hint}")


class PackResult(NamedTuple):
    rows: list[PackedRow]
    stats: PackStats


def _document_labels(ids: Sequence[int], mask: Sequence[int]) -> list[int]:
    labels = [nxt if keep else IGNORE_INDEX for nxt, keep in zip(ids[1:], mask[1:], strict=True)]
    labels.append(IGNORE_INDEX)
    return labels


def pack_examples(
    examples: Iterable[TokenizedConversation | tuple[Sequence[int], Sequence[int]]],
    seq_len: int,
    *,
    pad_token_id: int,
    overlong: Overlong = "truncate",
    seed: int = 0,
    shuffle: bool = True,
) -> PackResult:
    """Pack tokenized conversations into rows of exactly ``seq_len`` tokens; see the module doc for the layout.

    ``examples`` are :class:`TokenizedConversation` (with or without images) or ``(input_ids, loss_mask)`` pairs.
    They are shuffled with ``random.Random(seed)`` (unless ``shuffle=False``) and filled greedily in that order;
    the result is a pure function of the inputs. A row's ``pixel_values`` / ``image_grid_thw`` are its documents'
    own, concatenated in document order. A truncated document is cut before the first image that does not fit
    whole; that image and the later ones are dropped with their pixel rows.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or pad_token_id < 0:
        raise ValueError(f"pad_token_id must be a non-negative int, got {pad_token_id!r}")
    if overlong not in ("truncate", "drop"):
        raise ValueError(f"overlong must be 'truncate' or 'drop', got {overlong!r}")
    docs = [
        example
        if isinstance(example, TokenizedConversation)
        else TokenizedConversation(list(example[0]), list(example[1]))
        for example in examples
    ]
    for i, doc in enumerate(docs):
        if len(doc.input_ids) != len(doc.loss_mask):
            raise ValueError(f"example {i}: {len(doc.input_ids)} input ids but {len(doc.loss_mask)} loss-mask values")
        _check_images(doc, i)
    order = list(range(len(docs)))
    if shuffle:
        random.Random(seed).shuffle(order)

    rows: list[PackedRow] = []
    counts = dict.fromkeys(("truncated", "dropped", "empty", "documents", "no_loss_documents"), 0)
    row_ids: list[int] = []
    row_labels: list[int] = []
    row_lens: list[int] = []
    row_pixels: list[torch.Tensor] = []
    row_grids: list[torch.Tensor] = []

    def flush() -> None:
        padding = seq_len - len(row_ids)
        lens = list(row_lens)
        if padding:
            row_ids.extend([pad_token_id] * padding)
            row_labels.extend([IGNORE_INDEX] * padding)
            lens.append(padding)
        labels = torch.tensor(row_labels, dtype=torch.int64)
        rows.append(
            PackedRow(
                input_ids=torch.tensor(row_ids, dtype=torch.int64),
                labels=labels,
                seq_lens=tuple(lens),
                padding=padding,
                num_loss_tokens=int((labels != IGNORE_INDEX).sum()),
                pixel_values=torch.cat(row_pixels) if row_pixels else None,
                image_grid_thw=torch.cat(row_grids) if row_grids else None,
            )
        )
        for part in (row_ids, row_labels, row_lens, row_pixels, row_grids):
            part.clear()

    for index in order:
        doc = docs[index]
        ids, mask, pixels, grids = doc.input_ids, doc.loss_mask, doc.pixel_values, doc.image_grid_thw
        if not ids:
            counts["empty"] += 1
            continue
        if len(ids) > seq_len:
            if overlong == "drop":
                counts["dropped"] += 1
                continue
            ids, mask, pixels, grids = _truncate(doc, seq_len)
            if not ids:  # its first image starts the document: nothing before it is left
                counts["dropped"] += 1
                continue
            counts["truncated"] += 1
        if len(row_ids) + len(ids) > seq_len:
            flush()
        labels = _document_labels(ids, mask)
        if all(label == IGNORE_INDEX for label in labels):
            counts["no_loss_documents"] += 1
        row_ids.extend(ids)
        row_labels.extend(labels)
        row_lens.append(len(ids))
        if grids is not None:
            row_pixels.append(pixels)
            row_grids.append(grids)
        counts["documents"] += 1
    if row_lens:
        flush()
    stats = PackStats(
        rows=len(rows),
        loss_tokens=sum(r.num_loss_tokens for r in rows),
        padding_tokens=sum(r.padding for r in rows),
        **counts,
    )
    return PackResult(rows, stats)


def _check_images(doc: TokenizedConversation, index: int) -> None:
    """A document's images must be self-consistent, or packing would pair pads with another image's pixels."""
    if doc.image_grid_thw is None and doc.pixel_values is None and not doc.image_spans:
        return
    grids, pixels, spans = doc.image_grid_thw, doc.pixel_values, doc.image_spans
    if grids is None or pixels is None or grids.ndim != 2 or grids.size(-1) != 3 or len(grids) != len(spans):
        raise ValueError(
            f"example {index}: pixel_values, image_grid_thw [images, 3] and image_spans (one per image) go together; "
            f"got {None if grids is None else list(grids.shape)} grids and {len(spans)} spans"
        )
    if pixels.size(0) != int(grids.prod(-1).sum()):
        raise ValueError(f"example {index}: {pixels.size(0)} pixel rows for grids {grids.tolist()}")


def _truncate(doc: TokenizedConversation, seq_len: int) -> tuple[list[int], list[int], Any, Any]:
    """The first ``seq_len`` tokens of ``doc``, cut earlier if that would split an image: before the vision start
    of the first image that does not end within ``seq_len``, dropping it and the images after it."""
    cut, kept = seq_len, 0
    for start, end in doc.image_spans:
        if end > seq_len:
            cut = min(start, seq_len)
            break
        kept += 1
    if not kept:
        return doc.input_ids[:cut], doc.loss_mask[:cut], None, None
    grids = doc.image_grid_thw[:kept]
    pixels = doc.pixel_values[: int(grids.prod(-1).sum())]
    return doc.input_ids[:cut], doc.loss_mask[:cut], pixels, grids


def collate_packed(rows: Sequence[PackedRow]) -> dict[str, Any]:
    """``DataLoader`` collate: ``input_ids``/``labels`` [B, S] and ``seq_lens`` (a tuple per row). CP needs B = 1.

    Text rows only: rows with images raise rather than lose their images (feed those one row per micro-batch,
    with ``row.pixel_values`` / ``row.image_grid_thw``)."""
    with_images = [i for i, r in enumerate(rows) if r.image_grid_thw is not None]
    if with_images:
        raise ValueError(
            f"collate_packed stacks text rows only; rows {with_images} have images: feed rows with images one per "
            "micro-batch (row.pixel_values, row.image_grid_thw)"
        )
    return {
        "input_ids": torch.stack([r.input_ids for r in rows]),
        "labels": torch.stack([r.labels for r in rows]),
        "seq_lens": [r.seq_lens for r in rows],
        "num_loss_tokens": sum(r.num_loss_tokens for r in rows),
    }
