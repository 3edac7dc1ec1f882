"""The token store: tokenized documents on disk, read back through numpy memory maps.

A store is one folder under the cache directory, named by a hash of everything that changes the tokens (the data
files' content, the tokenizer and its chat template, the image processor's settings, the rendering options)::

    <cache_dir>/tokens-<key>/
        manifest.json                       counts, sources, skipped rows, the key's inputs (for the log)
        tokens.npy        int32 [T]         every document's ids, back to back
        loss_mask.npy     uint8 [T]         1 on assistant reply tokens
        doc_offsets.npy   int64 [D + 1]     document d is tokens[doc_offsets[d]:doc_offsets[d + 1]]
        doc_source.npy    int32 [D]         index into manifest["sources"]
        doc_row.npy       int64 [D]         1-based row in that file
        doc_loss.npy      int64 [D]         loss labels of the whole document (mask[1:].sum())
        image_offsets.npy int64 [D + 1]     document d has images image_offsets[d]:image_offsets[d + 1]
        image_spans.npy   int32 [I, 2]      [start, end) of each image's tokens, relative to its document
        image_grid.npy    int64 [I, 3]      its (t, h, w) patch grid
        image_stat.npy    int64 [I, 2]      (size, mtime_ns) of an image file, (-1, -1) for inline bytes
        image_kind.npy    uint8 [I]         0: a path or data URI (utf-8), 1: raw bytes
        image_ref_offsets.npy int64 [I + 1] image i's reference is image_refs[offsets[i]:offsets[i + 1]]
        image_refs.npy    uint8 [R]

Stores are written into a temporary folder and renamed into place when complete, so a crash never leaves a half
store under the final name; a store whose files do not match its manifest is set aside and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

STORE_FORMAT = 1
"""Bumped whenever tokenization or the store layout changes, so older stores are never reused."""

_DOC_ARRAYS = ("doc_offsets", "doc_source", "doc_row", "doc_loss", "image_offsets")
_TOKEN_ARRAYS = ("tokens", "loss_mask")
_IMAGE_ARRAYS = ("image_spans", "image_grid", "image_stat", "image_kind", "image_ref_offsets", "image_refs")
ARRAYS = _TOKEN_ARRAYS + _DOC_ARRAYS + _IMAGE_ARRAYS


def default_cache_dir() -> Path:
    """``$SFT_TRAINER_CACHE`` if set, else ``$XDG_CACHE_HOME/sft-trainer/data`` (``~/.cache/sft-trainer/data``)."""
    if os.environ.get("SFT_TRAINER_CACHE"):
        return Path(os.environ["SFT_TRAINER_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "sft-trainer" / "data"


# --------------------------------------------------------------------------------------------------------
# Keys


def _digest(*parts: Any) -> str:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        data = part if isinstance(part, bytes) else json.dumps(part, sort_keys=True, default=str).encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def file_digest(path: Path, memo: dict[str, Any] | None = None) -> str:
    """The content hash of a data file. ``memo`` maps a resolved path to ``{size, mtime_ns, digest}`` from an
    earlier call: a file whose size and mtime are unchanged is not read again."""
    stat = path.stat()
    key = str(path.resolve())
    known = (memo or {}).get(key)
    if known and known["size"] == stat.st_size and known["mtime_ns"] == stat.st_mtime_ns:
        return known["digest"]
    h = hashlib.blake2b(digest_size=16)
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    digest = h.hexdigest()
    if memo is not None:
        memo[key] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "digest": digest}
    return digest


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of what decides the tokenizer's output: its vocabulary, merges, normalizer and pre-tokenizer (the
    fast tokenizer's JSON), its added tokens and its chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    template = getattr(tokenizer, "chat_template", None)
    added = {str(k): str(v) for k, v in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    return _digest(type(tokenizer).__name__, body.encode(), template, added)


def processor_fingerprint(image_processor: Any) -> str | None:
    """A hash of the image processor's settings (its class and ``to_dict()``); None without one."""
    if image_processor is None:
        return None
    settings = image_processor.to_dict() if hasattr(image_processor, "to_dict") else vars(image_processor)
    return _digest(type(image_processor).__name__, settings)


def token_key(
    files: Sequence[Path],
    tokenizer: Any,
    *,
    image_processor: Any = None,
    options: Mapping[str, Any],
    memo: dict[str, Any] | None = None,
) -> tuple[str, dict[str, Any]]:
    """The store key and the inputs it hashes: every file's path and content, the tokenizer, the image processor
    and the rendering ``options`` (end of turn, template kwargs, vision tokens, error policy)."""
    inputs = {
        "format": STORE_FORMAT,
        "files": [[str(f.resolve()), file_digest(f, memo)] for f in files],
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "processor": processor_fingerprint(image_processor),
        "options": dict(options),
    }
    return _digest(inputs)[:20], inputs


# --------------------------------------------------------------------------------------------------------
# Reading


class StoreError(RuntimeError):
    """A store folder is incomplete or does not match its manifest."""


@dataclass
class TokenStore:
    """A complete store, its arrays memory-mapped (read-only; pages are loaded as rows touch them)."""

    path: Path
    manifest: dict[str, Any]
    arrays: dict[str, np.ndarray]

    @property
    def num_documents(self) -> int:
        return len(self.arrays["doc_offsets"]) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.arrays["tokens"])

    @property
    def has_images(self) -> bool:
        return len(self.arrays["image_grid"]) > 0

    def doc_lengths(self) -> np.ndarray:
        return np.diff(self.arrays["doc_offsets"])

    def __reduce__(self):
        # Sent to another process (a DataLoader worker) by path: the arrays are mapped again there, not copied.
        return (type(self).open, (self.path,))

    def image_ref(self, index: int) -> str | bytes:
        """Image ``index``'s reference as the data file gave it: a path or data URI (str) or raw bytes."""
        offsets = self.arrays["image_ref_offsets"]
        raw = self.arrays["image_refs"][offsets[index] : offsets[index + 1]].tobytes()
        return raw if self.arrays["image_kind"][index] == 1 else raw.decode("utf-8")

    @classmethod
    def open(cls, path: Path) -> TokenStore:
        """Map a complete store; raises :class:`StoreError` saying what is missing or inconsistent."""
        manifest_path = path / "manifest.json"
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, ValueError) as exc:
            raise StoreError(f"{manifest_path}: unreadable ({exc})") from None
        if manifest.get("format") != STORE_FORMAT:
            raise StoreError(f"{path}: store format {manifest.get('format')}, expected {STORE_FORMAT}")
        arrays = {}
        for name in ARRAYS:
            try:
                arrays[name] = np.load(path / f"{name}.npy", mmap_mode="r")
            except (OSError, ValueError) as exc:
                raise StoreError(f"{path / (name + '.npy')}: unreadable ({exc})") from None
        for name in _TOKEN_ARRAYS:  # rows read scattered slices: no readahead of neighbouring pages
            _random_access(arrays[name])
        counts = manifest["counts"]
        expected = {
            "tokens": counts["tokens"],
            "loss_mask": counts["tokens"],
            "doc_offsets": counts["documents"] + 1,
            "doc_source": counts["documents"],
            "doc_row": counts["documents"],
            "doc_loss": counts["documents"],
            "image_offsets": counts["documents"] + 1,
            "image_spans": counts["images"],
            "image_grid": counts["images"],
            "image_stat": counts["images"],
            "image_kind": counts["images"],
            "image_ref_offsets": counts["images"] + 1,
            "image_refs": counts["image_ref_bytes"],
        }
        for name, length in expected.items():
            if len(arrays[name]) != length:
                raise StoreError(f"{path / (name + '.npy')}: {len(arrays[name])} entries, the manifest says {length}")
        if arrays["doc_offsets"][-1] != counts["tokens"] or arrays["image_offsets"][-1] != counts["images"]:
            raise StoreError(f"{path}: document offsets do not end at the token and image counts")
        return cls(path, manifest, arrays)


def _random_access(array: np.ndarray) -> None:
    view = getattr(array, "_mmap", None)
    if view is not None and hasattr(mmap, "MADV_RANDOM"):
        view.madvise(mmap.MADV_RANDOM)


# --------------------------------------------------------------------------------------------------------
# Writing


def temporary_sibling(final: Path) -> Path:
    """A fresh folder beside ``final`` to write into before :func:`publish` renames it."""
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    return tmp


def publish(tmp: Path, final: Path) -> None:
    """Rename a finished folder into place (atomic on one filesystem). Another process that published the same
    key first wins: its store is identical, so ours is removed."""
    try:
        os.replace(tmp, final)
    except OSError:
        if (final / "manifest.json").is_file():
            shutil.rmtree(tmp, ignore_errors=True)
            return
        raise


def set_aside(path: Path) -> Path:
    """Move a broken store out of the way (kept for inspection, never reused) and return where it went."""
    target = path.parent / f".{path.name}.broken-{uuid.uuid4().hex[:8]}"
    os.replace(path, target)
    return target


def write_manifest(folder: Path, manifest: Mapping[str, Any]) -> None:
    """The manifest goes last: its presence marks the folder's arrays as complete."""
    tmp = folder / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, folder / "manifest.json")


def save_array(folder: Path, name: str, array: np.ndarray) -> None:
    np.save(folder / f"{name}.npy", np.ascontiguousarray(array))


def load_memo(path: Path) -> dict[str, Any]:
    """The data files' remembered content hashes (empty when missing or unreadable: files are hashed again)."""
    try:
        memo = json.loads(path.read_text())
        return memo if isinstance(memo, dict) else {}
    except (OSError, ValueError):
        return {}


def save_memo(path: Path, memo: Mapping[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        tmp.write_text(json.dumps(memo, sort_keys=True))
        os.replace(tmp, path)
    except OSError:  # a read-only or shared cache: the hashes are recomputed next time
        tmp.unlink(missing_ok=True)
