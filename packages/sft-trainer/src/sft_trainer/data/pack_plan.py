"""Best-fit-decreasing packing of a token store's documents into rows, kept on disk as a pack plan.

A plan lists, for every row, the documents it holds and how many tokens of each it takes (a document longer than
``seq_len`` is truncated, never inside an image, or dropped: the same rules as :func:`sft_trainer.data.pack_examples`).
Documents are never split across rows. Order: documents sorted by length, longest first (ties in an order
shuffled with ``seed``), each placed in the open row with the least room that fits it (a new row when none
does); the rows are then shuffled with ``seed``. The plan is a pure function of the store's lengths, ``seq_len``,
``overlong`` and ``seed``::

    <store>/pack-<key>/
        manifest.json                       the options and the :class:`~sft_trainer.data.PackStats`
        row_offsets.npy   int64 [rows + 1]  row r holds row_docs[row_offsets[r]:row_offsets[r + 1]]
        row_docs.npy      int64 [placed]    document indices, in row order
        doc_take.npy      int32 [D]         tokens of each document used (0: not packed)
"""

from __future__ import annotations

import bisect
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sft_trainer.data import store as data_store
from sft_trainer.data.conversations import Overlong
from sft_trainer.data.packing import PackStats

PACKING = "best_fit_decreasing"
_PLAN_FORMAT = 1


def usable_lengths(store: data_store.TokenStore, seq_len: int, overlong: Overlong) -> tuple[np.ndarray, dict]:
    """Tokens of each document that go into a row (0: empty or dropped) and the counts of truncated, dropped and
    empty documents. A truncated document is cut before the first image that does not end within ``seq_len``."""
    lengths = store.doc_lengths()
    take = np.minimum(lengths, seq_len).astype(np.int32)
    over = np.flatnonzero(lengths > seq_len)
    counts = {"empty": int((lengths == 0).sum()), "truncated": 0, "dropped": 0}
    image_offsets, spans = store.arrays["image_offsets"], store.arrays["image_spans"]
    for d in over.tolist():
        if overlong == "drop":
            take[d] = 0
            counts["dropped"] += 1
            continue
        cut = seq_len
        for start, end in spans[image_offsets[d] : image_offsets[d + 1]].tolist():
            if end > seq_len:
                cut = min(start, seq_len)
                break
        take[d] = cut
        counts["dropped" if cut == 0 else "truncated"] += 1
    return take, counts


def best_fit_decreasing(lengths: np.ndarray, seq_len: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(row_offsets, row_docs)`` packing the documents with ``0 < lengths[d] <= seq_len``; see the module doc."""
    rng = np.random.default_rng(seed)
    valid = np.flatnonzero(lengths > 0)
    valid = valid[rng.permutation(len(valid))]
    order = valid[np.argsort(-lengths[valid], kind="stable")]
    rows: list[list[int]] = []
    open_rows: dict[int, list[int]] = {}  # room left -> rows with that room (a stack: deterministic)
    rooms: list[int] = []  # the keys of open_rows, sorted
    for doc, length in zip(order.tolist(), lengths[order].tolist(), strict=True):
        at = bisect.bisect_left(rooms, length)
        if at == len(rooms):
            row, room = len(rows), seq_len - length
            rows.append([doc])
        else:
            fits = rooms[at]
            stack = open_rows[fits]
            row, room = stack.pop(), fits - length
            if not stack:
                del open_rows[fits]
                rooms.pop(at)
            rows[row].append(doc)
        if room:
            stack = open_rows.get(room)
            if stack is None:
                open_rows[room] = [row]
                bisect.insort(rooms, room)
            else:
                stack.append(row)
    shuffled = rng.permutation(len(rows))
    sizes = np.fromiter((len(rows[r]) for r in shuffled), np.int64, len(rows))
    offsets = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    docs = np.fromiter((d for r in shuffled.tolist() for d in rows[r]), np.int64, int(offsets[-1]))
    return offsets, docs


@dataclass
class PackPlan:
    path: Path
    row_offsets: np.ndarray
    row_docs: np.ndarray
    doc_take: np.ndarray
    stats: PackStats
    seq_len: int
    seed: int

    def __reduce__(self):
        return (type(self).open, (self.path,))

    @property
    def efficiency(self) -> float:
        """The fraction of row tokens that are document tokens (1 - padding)."""
        total = self.stats.rows * self.seq_len
        return 1.0 - self.stats.padding_tokens / total if total else 0.0

    @classmethod
    def open(cls, path: Path) -> PackPlan:
        try:
            manifest = json.loads((path / "manifest.json").read_text())
            arrays = {n: np.load(path / f"{n}.npy", mmap_mode="r") for n in ("row_offsets", "row_docs", "doc_take")}
        except (OSError, ValueError) as exc:
            raise data_store.StoreError(f"{path}: unreadable pack plan ({exc})") from None
        stats = PackStats(**manifest["stats"])
        if manifest.get("format") != _PLAN_FORMAT or len(arrays["row_offsets"]) != stats.rows + 1:
            raise data_store.StoreError(f"{path}: pack plan does not match its manifest")
        if arrays["row_offsets"][-1] != len(arrays["row_docs"]) or len(arrays["row_docs"]) != stats.documents:
            raise data_store.StoreError(f"{path}: pack plan does not match its manifest")
        return cls(path, **arrays, stats=stats, seq_len=manifest["seq_len"], seed=manifest["seed"])


def plan_key(seq_len: int, overlong: Overlong, seed: int) -> str:
    return data_store._digest(
        {"format": _PLAN_FORMAT, "packing": PACKING, "seq_len": seq_len, "overlong": overlong, "seed": seed}
    )[:16]


def _loss_tokens(store: data_store.TokenStore, take: np.ndarray, placed: np.ndarray) -> np.ndarray:
    """Loss labels of each placed document as packed: the store's count when whole, recounted when truncated."""
    loss = np.asarray(store.arrays["doc_loss"])[placed].copy()
    lengths = store.doc_lengths()[placed]
    offsets = store.arrays["doc_offsets"]
    mask = store.arrays["loss_mask"]
    for k in np.flatnonzero(take[placed] < lengths).tolist():
        start = int(offsets[placed[k]])
        loss[k] = int(mask[start + 1 : start + int(take[placed[k]])].sum())
    return loss


def write_pack_plan(
    store: data_store.TokenStore, seq_len: int, *, overlong: Overlong, seed: int, skipped_malformed: int
) -> PackPlan:
    """Pack ``store`` and save the plan in it (written beside its final folder, renamed into place)."""
    final = store.path / f"pack-{plan_key(seq_len, overlong, seed)}"
    take, counts = usable_lengths(store, seq_len, overlong)
    row_offsets, row_docs = best_fit_decreasing(take, seq_len, seed)
    placed = np.sort(row_docs)
    loss = _loss_tokens(store, take, placed)
    rows = len(row_offsets) - 1
    stats = PackStats(
        rows=rows,
        documents=len(row_docs),
        truncated=counts["truncated"],
        dropped=counts["dropped"],
        empty=counts["empty"],
        skipped_malformed=skipped_malformed,
        loss_tokens=int(loss.sum()),
        padding_tokens=int(rows * seq_len - int(take[placed].sum())),
        no_loss_documents=int((loss == 0).sum()),
    )
    tmp = data_store.temporary_sibling(final)
    try:
        for name, array in (("row_offsets", row_offsets), ("row_docs", row_docs), ("doc_take", take)):
            data_store.save_array(tmp, name, array)
        manifest: dict[str, Any] = {
            "format": _PLAN_FORMAT,
            "packing": PACKING,
            "seq_len": seq_len,
            "overlong": overlong,
            "seed": seed,
            "stats": stats.as_dict(),
        }
        data_store.write_manifest(tmp, manifest)
        data_store.publish(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return PackPlan.open(final)


def open_or_write_pack_plan(store: data_store.TokenStore, seq_len: int, *, overlong: Overlong, seed: int) -> PackPlan:
    """The store's plan for these options: reused when complete, else (re)written."""
    final = store.path / f"pack-{plan_key(seq_len, overlong, seed)}"
    if final.exists():
        try:
            return PackPlan.open(final)
        except data_store.StoreError:
            data_store.set_aside(final)
    return write_pack_plan(store, seq_len, overlong=overlong, seed=seed, skipped_malformed=store.manifest["skipped"])
