"""Conversations from JSONL/Parquet files: the message schema, its validation and the row readers."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

IGNORE_INDEX = -100
"""Label of tokens without loss (``torch.nn.functional.cross_entropy``'s default ``ignore_index``)."""
ROLES = ("system", "user", "assistant")
OnError = Literal["raise", "skip"]
Overlong = Literal["truncate", "drop"]

_ASSETS = Path(__file__).resolve().parent.parent / "assets"
_JSONL_SUFFIXES = (".jsonl", ".ndjson")
_PARQUET_SUFFIXES = (".parquet", ".pq")
_MAX_REPORTED = 20


def tiny_tokenizer_dir() -> Path:
    """The shipped tiny byte-level BPE tokenizer with a ChatML template (``AutoTokenizer.from_pretrained``-able)."""
    return _ASSETS / "tiny_tokenizer"


def tiny_chat_path() -> Path:
    """The shipped synthetic chat dataset (400 conversations, JSONL, ``messages`` format)."""
    return _ASSETS / "tiny_chat.jsonl"


def tiny_vl_processor_dir() -> Path:
    """The shipped tiny VL processor folder: the tiny tokenizer plus the vision tokens and a ChatML template that
    renders image parts, and a Qwen2-VL image processor config (patch 8, merge 2); see :func:`load_processor`."""
    return _ASSETS / "tiny_vl_processor"


def tiny_vl_chat_path() -> Path:
    """The shipped synthetic image chat dataset (JSONL; its image paths are relative to its folder)."""
    return _ASSETS / "tiny_vl_chat" / "data.jsonl"


class DataError(ValueError):
    """A data row (or file) is malformed; the message names the file, the 1-based row and the problem."""


class Conversation(NamedTuple):
    """One conversation and where it came from; unpacks as ``(source, row_number, messages)``."""

    source: str
    row_number: int
    """1-based row in ``source`` (for JSONL: the line number)."""
    messages: list[dict[str, Any]]
    """``{"role", "content"}`` with content a string or a list of text/image parts (see :func:`validate_messages`)."""


@dataclass
class LoadedConversations:
    """The valid conversations of one or more files, in file and row order, and what was skipped."""

    conversations: list[Conversation] = field(default_factory=list)
    skipped: int = 0
    """Malformed rows skipped (``on_error="skip"``)."""
    skip_reasons: list[str] = field(default_factory=list)
    """The error messages of the first skipped rows (at most 20), for the log."""

    def __iter__(self) -> Iterator[Conversation]:
        return iter(self.conversations)

    def __len__(self) -> int:
        return len(self.conversations)

    def __getitem__(self, index: int) -> Conversation:
        return self.conversations[index]


def validate_messages(row: Any) -> list[dict[str, Any]]:
    """The ``messages`` of one row as ``[{"role", "content"}]``; raises ``ValueError`` saying what is wrong.

    A content is a string or a list of parts ``{"type": "text", "text": str}`` / ``{"type": "image", "image": X}``
    (X: a path, a ``data:image/...;base64,`` URI, bytes, or ``{"bytes", "path"}``); parts keep only those keys.
    """
    if not isinstance(row, Mapping):
        raise ValueError(f"expected an object with a 'messages' list, got {type(row).__name__}")
    if "messages" not in row:
        raise ValueError(f"missing 'messages' (row keys: {sorted(map(str, row))})")
    messages = row["messages"]
    if not isinstance(messages, list):
        raise ValueError(f"'messages' must be a list of messages, got {type(messages).__name__}")
    if not messages:
        raise ValueError("'messages' is empty")
    clean = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content', got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role is {role!r}; expected one of {', '.join(ROLES)}")
        if isinstance(content, list):
            content = [_validate_part(part, f"messages[{i}].content[{j}]") for j, part in enumerate(content)]
        elif not isinstance(content, str):
            raise ValueError(
                f"messages[{i}].content must be a string or a list of text/image parts, got {type(content).__name__}"
            )
        clean.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in clean):
        raise ValueError("no assistant message: the conversation has nothing to learn")
    return clean


def _validate_part(part: Any, where: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, Mapping) else None
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}: a text part needs a string 'text', got {type(part.get('text')).__name__}")
        return {"type": "text", "text": part["text"]}
    if kind == "image":
        image = part.get("image")
        if isinstance(image, Mapping):  # HF datasets' Image struct: bytes, or a path when bytes is null
            ok = any(isinstance(image.get(key), str | bytes) and image.get(key) for key in ("bytes", "path"))
        else:
            ok = isinstance(image, str | bytes)
        if not ok or not image:
            raise ValueError(
                f"{where}: an image part needs 'image': a file path, a data:image/...;base64 URI, bytes, or "
                f"{{'bytes': bytes, 'path': str}} (one of them set); got {_describe(image)}"
            )
        return {"type": "image", "image": image}
    if kind == "video":
        raise ValueError(f"{where}: videos are not supported (only images: {{'type': 'image', 'image': ...}})")
    raise ValueError(f"{where}: unknown content part {_describe(part)}; parts are {{'type': 'text' | 'image', ...}}")


def _describe(value: Any) -> str:
    """A short repr for error messages (no image bytes or base64 walls)."""
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in value.items()) + "}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def not_a_regular_file(path: Path) -> str | None:
    """Why the existing entry ``path`` cannot be read as a data file (a FIFO or a device would block the reader, a
    link that leads nowhere fails it), or None for a regular file, a folder or a path that does not exist."""
    if path.is_file() or path.is_dir():
        return None
    if path.is_symlink() and not path.exists():
        return "a symbolic link to nothing (its target is missing)"
    if path.exists():
        return "not a regular file (a FIFO, socket or device); data files are read whole"
    return None


def _expand_paths(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    items = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    files: list[Path] = []
    for item in items:
        path = Path(item)
        if path.is_dir():
            found = sorted(
                p
                for p in path.rglob("*")
                if p.suffix in _JSONL_SUFFIXES + _PARQUET_SUFFIXES
                # hidden files and folders (macOS's ._ resource forks, .cache) are not data, as for load_dataset
                and not any(part.startswith(".") for part in p.relative_to(path).parts)
                # a folder named like a data file: rglob lists its files too (not through a link: refused below)
                and not (p.is_dir() and not p.is_symlink())
            )
            for entry in found:
                if entry.is_dir():
                    raise DataError(
                        f"{entry} (in data folder {path}): a link to a folder, whose files are not searched; put "
                        "them in the data folder, or name the linked folder in data.path"
                    )
                if problem := not_a_regular_file(entry):
                    raise DataError(f"{entry} (in data folder {path}): {problem}; remove it or move it out")
            if not found:
                raise DataError(f"{path}: directory holds no .jsonl or .parquet files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        elif problem := not_a_regular_file(path):
            raise DataError(f"{path}: {problem}")
        else:
            raise FileNotFoundError(f"data file not found: {path}")
    if not files:
        raise DataError("no data files given")
    return files


def _jsonl_rows(
    path: Path, start: int = 0, end: int | None = None, first_line: int = 1
) -> Iterator[tuple[int, Any, str | None]]:
    """``(line_number, row, problem)`` for every non-blank line (``problem`` set when it is not valid JSON); with
    ``start``/``end``, only the lines in that byte range (``start`` at a line start, numbered from ``first_line``)."""
    with path.open("rb") as f:
        f.seek(start)
        lines = f if end is None else io.BytesIO(f.read(end - start))
        for number, raw in enumerate(lines, start=first_line):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield number, None, f"not valid UTF-8 ({exc.reason} at byte {exc.start})"
                continue
            if not line.strip():
                continue
            try:
                yield number, json.loads(line), None
            except json.JSONDecodeError as exc:
                yield number, None, f"invalid JSON ({exc.msg} at column {exc.colno})"


def _open_parquet(path: Path, column: str = "messages"):
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:
        raise DataError(f"{path}: cannot read as Parquet ({exc})") from exc
    names = parquet.schema_arrow.names
    if column not in names:
        hint = "" if column == "messages" else " (data.messages_column)"
        raise DataError(f"{path}: no {column!r} column{hint} (columns: {names})")
    return parquet


def _parquet_rows(
    path: Path, row_groups: Sequence[int] | None = None, first_row: int = 1, column: str = "messages"
) -> Iterator[tuple[int, Any, str | None]]:
    """``(row_number, row, None)`` of every row (of ``row_groups`` only when given, numbered from ``first_row``),
    each row holding ``column`` only."""
    parquet = _open_parquet(path, column)
    number = first_row - 1
    for batch in parquet.iter_batches(batch_size=1024, columns=[column], row_groups=row_groups):
        for row in batch.to_pylist():
            number += 1
            yield number, row, None


def load_conversations(
    paths: str | os.PathLike | Sequence[str | os.PathLike], *, on_error: OnError = "raise"
) -> LoadedConversations:
    """Read and validate the conversations of local JSONL/Parquet files (a directory: all of them, sorted).

    Returns the valid ``(source, row_number, messages)`` in order. A malformed row (bad JSON, no ``messages``,
    an empty list, a wrong role or content type, no assistant message) raises :class:`DataError` naming the
    file, the 1-based row and the problem, or with ``on_error="skip"`` is skipped and counted in ``.skipped``.
    """
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    loaded = LoadedConversations()
    for path in _expand_paths(paths):
        if path.suffix in _JSONL_SUFFIXES:
            rows = _jsonl_rows(path)
        elif path.suffix in _PARQUET_SUFFIXES:
            rows = _parquet_rows(path)
        else:
            raise DataError(f"{path}: unsupported data file type {path.suffix!r}; use .jsonl or .parquet")
        for number, row, problem in rows:
            if problem is None:
                try:
                    messages = validate_messages(row)
                except ValueError as exc:
                    problem = str(exc)
            if problem is not None:
                message = f"{path}: row {number}: {problem}"
                if on_error == "raise":
                    raise DataError(message)
                loaded.skipped += 1
                if len(loaded.skip_reasons) < _MAX_REPORTED:
                    loaded.skip_reasons.append(message)
                continue
            loaded.conversations.append(Conversation(str(path), number, messages))
    return loaded
