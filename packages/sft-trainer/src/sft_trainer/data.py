"""Packed chat data: read conversations, tokenize them with a loss mask, pack them into rows of exactly ``S`` tokens.

The pipeline, each step usable on its own::

    loaded = load_conversations("chats.jsonl", on_error="skip")           # (source, row, messages) + skip count
    docs = [tokenize_conversation(tokenizer, c.messages) for c in loaded]  # input_ids + assistant loss mask
    rows, stats = pack_examples(docs, seq_len=4096, pad_token_id=tokenizer.pad_token_id, seed=0)

or all at once, as a map-style dataset, and the rows of one data-parallel rank::

    dataset = PackedDataset.build("chats.jsonl", tokenizer, seq_len=4096, seed=0, group=cp_group)
    for row in rows_for_rank(dataset, dp_rank, dp_size, epoch=epoch):
        row.input_ids, row.labels, row.seq_lens          # [S] int64, [S] int64, tuple of ints summing to S

**Input.** JSONL (one JSON object per line) or Parquet, each row holding ``messages``: a non-empty list of
``{"role": "system" | "user" | "assistant", "content": str}`` with at least one assistant message (extra keys
are ignored). A bad row raises :class:`DataError` naming the file, the 1-based row (for JSONL: the line number)
and the problem; with ``on_error="skip"`` it is skipped and counted instead. Problems with a whole file
(missing, unreadable, no ``messages`` column, unknown suffix) always raise.

**Images.** A content may also be a list of parts, ``{"type": "text", "text": str}`` and ``{"type": "image",
"image": X}`` with X a path (relative to the data file's folder and inside it, unless ``image_paths_outside``), a ``data:image/...;base64,`` URI,
bytes, or ``{"bytes", "path"}`` (the HF datasets Image struct, as Parquet stores it); videos are refused. Pass
``image_processor`` (transformers' Qwen2-VL image processor, see :func:`load_processor`): the chat template
renders each image as ``<|vision_start|><|image_pad|><|vision_end|>`` and the one pad token becomes the image's
``t * h * w / merge_size**2`` tokens; the documents carry ``pixel_values`` and ``image_grid_thw``. Image tokens
never carry loss. An image that cannot be read, a template that drops images, pad counts that do not match the
grids, or placeholder tokens typed into the text raise like a malformed row (or are skipped and counted).

**Loss mask.** 1 exactly on the tokens an assistant must generate: its content and the end-of-turn marker
(``<|im_end|>`` for ChatML), 0 on system/user messages and template text such as ``<|im_start|>assistant\\n``.
The chat template is rendered once for the whole conversation and once per assistant turn up to its generation
prompt; the assistant span starts where the generation prompt ends. The text is then tokenized in pieces cut at
the span boundaries, so a span's tokens are exactly what the model produces after the prompt at inference
(no token straddles a boundary, and the mask is exact by construction).

**Packing.** Documents (tokenized conversations) are shuffled with ``seed`` and concatenated greedily, in that
order, into rows of exactly ``seq_len`` tokens; a document that does not fit in the rest of a row starts the next
row and the rest is padding, a document of its own (pad ids, labels -100). Documents are never split across rows;
ones longer than ``seq_len`` are truncated to ``seq_len`` (never inside an image: the cut moves to before the
first image that does not fit whole, which is dropped with the images after it) or dropped, and counted. A row
keeps its documents' images: ``pixel_values`` and ``image_grid_thw`` concatenated in document order. A document
may be far longer than a CP shard (``seq_len / cp``): CP handles documents straddling shard cuts. ``labels[t]``
is the next token ``input_ids[t + 1]`` when ``t + 1`` lies in the same document and is a loss token, else -100,
so labels are already shifted and can be sharded with the input ids (``cp_core.shard_sequence``); the last token
of every document has label -100.

**Ranks.** All ranks of a CP group must train on the same rows, different data-parallel replicas on different
rows: :func:`rows_for_rank` takes the *dp* coordinates only. Building is deterministic, so every process may build
the dataset itself (each reads and tokenizes the whole file once); pass ``group=`` to :meth:`PackedDataset.build`
to have rank 0 of that group build it and broadcast it to the others instead.

This module's :class:`PackedDataset` holds its rows in memory. Training (:func:`build_training_rows`) reads them
from the on-disk token cache instead: :mod:`sft_trainer.data_store` (the store), :mod:`sft_trainer.data_tokenize`
(parallel tokenization), :mod:`sft_trainer.data_packing` (best-fit-decreasing pack plans) and
:mod:`sft_trainer.data_rows` (rows assembled per index, images processed lazily); it also takes data in other
forms (another column, ShareGPT turns, HF ``datasets`` folders and hub ids): :mod:`sft_trainer.data_sources`.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
import pickle
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, Subset

__all__ = [
    "IGNORE_INDEX",
    "ROLES",
    "Conversation",
    "DataError",
    "LoadedConversations",
    "OnError",
    "Overlong",
    "PackResult",
    "PackStats",
    "PackedDataset",
    "PackedRow",
    "TokenizedConversation",
    "VisionTokens",
    "assistant_spans",
    "build_training_rows",
    "collate_packed",
    "conversation_images",
    "load_conversations",
    "load_image",
    "load_image_processor",
    "load_processor",
    "pack_examples",
    "rows_for_rank",
    "tiny_chat_path",
    "tiny_tokenizer_dir",
    "tiny_vl_chat_path",
    "tiny_vl_processor_dir",
    "tokenize_conversation",
    "validate_messages",
]

IGNORE_INDEX = -100
"""Label of tokens without loss (``torch.nn.functional.cross_entropy``'s default ``ignore_index``)."""
ROLES = ("system", "user", "assistant")
OnError = Literal["raise", "skip"]
Overlong = Literal["truncate", "drop"]

_ASSETS = Path(__file__).resolve().parent / "assets"
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


# --------------------------------------------------------------------------------------------------------
# Loading


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


def _expand_paths(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    items = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    files: list[Path] = []
    for item in items:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.suffix in _JSONL_SUFFIXES + _PARQUET_SUFFIXES)
            if not found:
                raise DataError(f"{path}: directory holds no .jsonl or .parquet files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
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


# --------------------------------------------------------------------------------------------------------
# Images


@dataclass(frozen=True)
class VisionTokens:
    """The image placeholder tokens of a VL tokenizer (the defaults are Qwen2-VL's to Qwen3.5-VL's strings).

    The chat template renders an image as ``vision_start + image_pad + vision_end``; the pad is expanded to the
    image's token count. None of them may appear in message text, and none carries loss. Pass another instance
    (``tokenize_conversation(..., vision_tokens=VisionTokens(image_pad="<image>"))``) for other spellings.
    """

    image_pad: str = "<|image_pad|>"
    vision_start: str = "<|vision_start|>"
    vision_end: str = "<|vision_end|>"
    video_pad: str = "<|video_pad|>"

    def ids(self, tokenizer: Any) -> dict[str, int]:
        """``{"image_pad": id, ...}`` for the tokens ``tokenizer`` has as single tokens (absent ones left out)."""
        found = {}
        for name, token in asdict(self).items():
            token_id = tokenizer.convert_tokens_to_ids(token)  # no get_vocab(): that copies the whole vocabulary
            if isinstance(token_id, int) and tokenizer.convert_ids_to_tokens(token_id) == token:
                found[name] = token_id
        return found


def conversation_images(messages: Sequence[Mapping[str, Any]]) -> list[tuple[str, Any]]:
    """``(where, image)`` of each image part of validated ``messages``, in order (``where``:
    ``messages[i].content[j]``)."""
    return [
        (f"messages[{i}].content[{j}]", part["image"])
        for i, message in enumerate(messages)
        if isinstance(message["content"], list)
        for j, part in enumerate(message["content"])
        if part["type"] == "image"
    ]


def load_image(image: Any, base_dir: str | os.PathLike | None = None, outside_ok: bool = False):
    """An RGB ``PIL.Image`` from an image part's value: a path (relative to ``base_dir``, default the working
    directory), a ``data:image/...;base64,`` URI, bytes, or ``{"bytes", "path"}``. With ``base_dir`` a path must
    stay inside it (not absolute, no ``..`` leading out, symlinks resolved) unless ``outside_ok``. Raises
    ``ValueError`` saying which file or how many bytes failed, and why."""
    from PIL import Image

    if isinstance(image, Mapping):
        image = image.get("bytes") or image.get("path")
    if isinstance(image, str) and image.startswith("data:"):
        header, sep, payload = image.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ValueError(f"image data URI {_describe(image)}: only data:image/...;base64,<data> URIs are read")
        try:
            image = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"image data URI {_describe(image)} is not valid base64 ({exc})") from None
    if isinstance(image, str):
        if image.startswith(("http://", "https://")):
            raise ValueError(f"image {image!r}: URLs are not fetched; download the images and give their paths")
        path = Path(image.removeprefix("file://"))
        if base_dir is not None:
            inside = (Path(base_dir) / path).resolve().is_relative_to(Path(base_dir).resolve())
            if not outside_ok and (path.is_absolute() or not inside):
                raise ValueError(
                    f"image path {image!r} leads outside the dataset's folder {str(base_dir)!r}; give paths relative "
                    "to it, or set data.image_paths_outside = true to allow others"
                )
            path = Path(base_dir) / path
        if not path.is_file():
            raise ValueError(f"image file '{path}' does not exist")
        source, label = path, f"image file '{path}'"
    elif isinstance(image, bytes):
        source, label = io.BytesIO(image), f"image of {len(image)} bytes"
    else:
        raise ValueError(f"cannot read an image from {_describe(image)}")
    try:
        with Image.open(source) as opened:
            return opened.convert("RGB")
    except Exception as exc:  # PIL raises several types (UnidentifiedImageError, OSError, SyntaxError, ...)
        raise ValueError(f"cannot decode {label}: {exc}") from None


def load_image_processor(folder: str | os.PathLike):
    """The image processor of a processor folder (``preprocessor_config.json``), on its Pillow backend.

    Pillow, not torchvision, so pixel values do not depend on what else is installed (and torchvision is not
    needed): ``AutoImageProcessor`` with ``backend="pil"``, or where ``AutoImageProcessor`` itself demands
    torchvision (transformers 5.17), the config's ``<image_processor_type>Pil`` class directly.
    """
    import transformers
    from transformers import AutoImageProcessor

    config = Path(folder) / "preprocessor_config.json"
    if Path(folder).is_dir() and not config.is_file():
        raise FileNotFoundError(
            f"{folder}: no preprocessor_config.json; data.processor must be a folder with the image processor's "
            "config (a Qwen3.5-VL checkpoint folder has one)"
        )
    try:
        return AutoImageProcessor.from_pretrained(folder, backend="pil")
    except ImportError:
        kind = json.loads(config.read_text()).get("image_processor_type", "")
        pil = getattr(transformers, kind.removesuffix("Fast").removesuffix("Pil") + "Pil", None)
        if pil is None:
            raise
        return pil.from_pretrained(folder)


def load_processor(folder: str | os.PathLike) -> tuple[Any, Any]:
    """``(tokenizer, image_processor)`` of a processor (or VL checkpoint) folder: ``AutoTokenizer`` and
    :func:`load_image_processor`."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder), load_image_processor(folder)


def _pad_runs(ids: Sequence[int], pad: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each maximal run of ``pad`` in ``ids``."""
    runs: list[tuple[int, int]] = []
    start = None
    for t, token in enumerate(ids):
        if token == pad:
            if start is None:
                start = t
        elif start is not None:
            runs.append((start, t))
            start = None
    if start is not None:
        runs.append((start, len(ids)))
    return runs


def _refuse_placeholder_text(messages: Sequence[Mapping[str, Any]], tokens: VisionTokens, ids: Mapping) -> None:
    """A placeholder typed into text would be tokenized as one and taken for an image (or break the counts)."""
    present = [token for name, token in asdict(tokens).items() if name in ids]
    for i, message in enumerate(messages):
        content = message["content"]
        texts = [content] if isinstance(content, str) else [p["text"] for p in content if p["type"] == "text"]
        for token in present:
            if any(token in text for text in texts):
                raise ValueError(
                    f"messages[{i}] ({message['role']}) text holds the image placeholder token {token!r}: give images "
                    "as {'type': 'image'} parts; a placeholder in text would be taken for an image"
                )


def _expand_images(
    input_ids: list[int],
    loss_mask: list[int],
    images: list[tuple[str, Any]],
    tokens: VisionTokens,
    ids: Mapping[str, int],
    image_processor: Any,
    base_dir: str | os.PathLike | None,
    outside_ok: bool = False,
) -> TokenizedConversation:
    """Check the rendered placeholders against the image parts, run the images through the processor, expand
    each image's pad to its grid's token count, and zero the loss mask on every vision token."""
    if "image_pad" not in ids:  # a text tokenizer: no placeholders to check (images were refused earlier)
        return TokenizedConversation(input_ids, loss_mask)
    pad = ids["image_pad"]
    runs = _pad_runs(input_ids, pad)
    if len(runs) != len(images):
        what = "images without tokens" if len(runs) < len(images) else "image tokens without images"
        raise ValueError(
            f"{what}: the chat template rendered {len(runs)} {tokens.image_pad} placeholder(s) for {len(images)} "
            f"image part(s); it must render each image part once (Qwen-VL: {tokens.vision_start}{tokens.image_pad}"
            f"{tokens.vision_end})"
        )
    if not images:
        return TokenizedConversation(input_ids, loss_mask)
    pictures = []
    for where, image in images:
        try:
            pictures.append(load_image(image, base_dir, outside_ok))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    try:
        processed = image_processor(images=pictures, return_tensors="pt")
    except ValueError as exc:
        raise ValueError(f"the image processor refused the conversation's images: {exc}") from None
    grids = torch.as_tensor(processed["image_grid_thw"]).to(torch.int64).reshape(-1, 3)
    pixels = torch.as_tensor(processed["pixel_values"]).to(torch.float32)
    merge = getattr(image_processor, "merge_size", None)
    if not isinstance(merge, int) or merge < 1:
        raise ValueError(f"the image processor has no integer merge_size (got {merge!r}); a Qwen2-VL one is needed")
    patches = grids.prod(-1)
    if len(grids) != len(images) or pixels.size(0) != int(patches.sum()) or (patches % merge**2).any():
        raise ValueError(
            f"the image processor gave grids {grids.tolist()} and {pixels.size(0)} patch rows for {len(images)} "
            f"image(s) with merge_size {merge}"
        )
    counts = (patches // merge**2).tolist()
    start_id, end_id = ids.get("vision_start"), ids.get("vision_end")
    out_ids: list[int] = []
    out_mask: list[int] = []
    spans: list[tuple[int, int]] = []
    cursor = 0
    for k, ((start, end), count) in enumerate(zip(runs, counts, strict=True)):
        if end - start not in (1, count):  # one pad to expand, or already the image's count
            raise ValueError(
                f"image-token counts that do not match grids: image {k} ({images[k][0]}) has {end - start} "
                f"{tokens.image_pad} tokens, its grid {grids[k].tolist()} needs {count} (or 1, to be expanded)"
            )
        out_ids += input_ids[cursor:start]
        out_mask += loss_mask[cursor:start]
        first = len(out_ids) - 1 if out_ids and out_ids[-1] == start_id else len(out_ids)
        out_ids += [pad] * count
        out_mask += [0] * count
        last = len(out_ids) + 1 if end < len(input_ids) and input_ids[end] == end_id else len(out_ids)
        spans.append((first, last))  # the image's tokens: its vision start, pads and vision end
        cursor = end
    out_ids += input_ids[cursor:]
    out_mask += loss_mask[cursor:]
    vision = set(ids.values())  # never loss on a vision token, wherever the image sits (even in a reply)
    out_mask = [0 if token in vision else flag for token, flag in zip(out_ids, out_mask, strict=True)]
    return TokenizedConversation(out_ids, out_mask, pixels, grids, tuple(spans))


# --------------------------------------------------------------------------------------------------------
# Tokenizing


@dataclass(frozen=True, eq=False)
class TokenizedConversation:
    """Token ids of one rendered conversation and its loss mask (1 on assistant reply tokens), and its images as
    the image processor gives them. Unpacks as ``ids, mask = conversation``."""

    input_ids: list[int]
    loss_mask: list[int]
    pixel_values: torch.Tensor | None = None
    """float32 [patches, C * T * P * P]: the conversation's images in order; None without images."""
    image_grid_thw: torch.Tensor | None = None
    """int64 [images, 3]: each image's (t, h, w) patch grid; it has ``t * h * w / merge_size**2`` pad tokens."""
    image_spans: tuple[tuple[int, int], ...] = ()
    """``[start, end)`` token range of each image: its vision start, pads and vision end."""

    def __iter__(self) -> Iterator[list[int]]:
        return iter((self.input_ids, self.loss_mask))

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def num_images(self) -> int:
        return len(self.image_spans)


def _render(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool, kwargs: Mapping) -> str:
    # Templates see image parts without their payload (bytes or a base64 wall have no business in the text).
    messages = [
        {**m, "content": [p if p["type"] == "text" else {"type": "image", "image": "image"} for p in m["content"]]}
        if isinstance(m["content"], list)
        else m
        for m in messages
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs)
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, expected str")
    return text


def _default_end_of_turn(tokenizer: Any) -> str | None:
    vocab = tokenizer.get_vocab()
    if "<|im_end|>" in vocab:
        return "<|im_end|>"
    return tokenizer.eos_token


def _find_reply(full: str, start: int, text: str) -> tuple[int, int] | None:
    """Where ``text`` (or, for templates that trim replies, its stripped form) first occurs at or after ``start``."""
    found = full.find(text, start)
    if found < 0:
        text = text.strip()
        found = full.find(text, start) if text else start
    return None if found < 0 else (found, found + len(text))


def assistant_spans(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    end_of_turn: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    vision_tokens: VisionTokens | None = None,
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans ``[start, end)`` of its assistant replies.

    A span starts where the generation prompt of the conversation so far ends and runs to the end of the
    reply's content plus the ``end_of_turn`` marker that follows it (when only whitespace lies between).
    Empty replies get no span. Raises ``ValueError`` if the template is not prefix-stable (the conversation
    up to a reply plus its generation prompt is not a prefix of the whole rendering).

    A reply given as parts is found part by part: its text parts in order; images rendered after its last text
    (``vision_tokens``) may lie before the end-of-turn marker. A span may thus hold image placeholders; they get
    no loss (:func:`tokenize_conversation` zeroes the mask on every vision token). A reply without text is empty.
    """
    kwargs = dict(chat_template_kwargs or {})
    if end_of_turn is None:
        end_of_turn = _default_end_of_turn(tokenizer)
    markup = list(asdict(vision_tokens or VisionTokens()).values())
    full = _render(tokenizer, messages, False, kwargs)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, message in enumerate(messages):
        content = message["content"]
        texts = [content] if isinstance(content, str) else [p["text"] for p in content if p["type"] == "text"]
        if message["role"] != "assistant" or not any(texts):
            continue
        prefix = _render(tokenizer, messages[:i], True, kwargs)
        if not full.startswith(prefix):
            raise ValueError(
                f"the chat template is not prefix-stable at messages[{i}]: rendering the messages before it with "
                "add_generation_prompt=True is not a prefix of the whole conversation's rendering"
            )
        start = end = len(prefix)
        for text in filter(None, texts):
            found = _find_reply(full, end, text)
            if found is None:
                raise ValueError(f"the content of messages[{i}] (assistant) does not appear in the rendered template")
            end = found[1]
        if end_of_turn:
            marker = full.find(end_of_turn, end)
            between = full[end:marker]
            if not isinstance(content, str):  # images after a reply's last text part
                for token in markup:
                    between = between.replace(token, "")
            if marker >= 0 and not between.strip():
                end = marker + len(end_of_turn)
        if start < cursor:
            raise ValueError(f"the reply span of messages[{i}] overlaps the previous one")
        spans.append((start, end))
        cursor = end
    return full, spans


def tokenize_conversation(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    end_of_turn: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    image_processor: Any = None,
    base_dir: str | os.PathLike | None = None,
    vision_tokens: VisionTokens | None = None,
    image_paths_outside: bool = False,
) -> TokenizedConversation:
    """Token ids of ``messages`` rendered with the tokenizer's chat template, and the assistant loss mask.

    ``loss_mask[t] == 1`` exactly on the tokens of assistant replies: content and the ``end_of_turn`` marker
    (default ``<|im_end|>`` when the vocabulary has it, else the eos token). Empty replies add no loss tokens.
    The text is tokenized in pieces cut at the reply boundaries (no special tokens added beyond the
    template's own), which is how a prompt and the reply generated after it are tokenized at inference.

    Image parts (paths relative to ``base_dir``, default the working directory) are loaded as RGB and run through
    ``image_processor`` in one call; each image's single ``vision_tokens.image_pad`` becomes ``t * h * w //
    merge_size**2`` pads, ``(t, h, w)`` its ``image_grid_thw``. Vision tokens never carry loss. Raises
    ``ValueError`` for images without a processor or unreadable, a template that drops images, pad counts that
    do not match the grids, and placeholder tokens typed into the text.
    """
    tokens = vision_tokens or VisionTokens()
    ids = tokens.ids(tokenizer)
    images = conversation_images(messages)
    _refuse_placeholder_text(messages, tokens, ids)
    if images and image_processor is None:
        raise ValueError(
            f"the conversation has {len(images)} image(s) but no image processor is set: train a Qwen3.5-VL model "
            "(model.preset = 'tiny-qwen3_5-vl' or a VL checkpoint) with data.processor naming its processor folder "
            "(with preprocessor_config.json); from Python, pass image_processor="
        )
    if images and "image_pad" not in ids:
        raise ValueError(
            f"the conversation has {len(images)} image(s) but the tokenizer has no {tokens.image_pad!r} token: use "
            "the VL model's tokenizer (its processor folder)"
        )
    full, spans = assistant_spans(
        tokenizer, messages, end_of_turn=end_of_turn, chat_template_kwargs=chat_template_kwargs, vision_tokens=tokens
    )
    pieces: list[tuple[str, int]] = []
    cursor = 0
    for start, end in spans:
        pieces.append((full[cursor:start], 0))
        pieces.append((full[start:end], 1))
        cursor = end
    pieces.append((full[cursor:], 0))
    pieces = [(text, flag) for text, flag in pieces if text]
    encoded = tokenizer([text for text, _ in pieces], add_special_tokens=False)["input_ids"]
    input_ids: list[int] = []
    loss_mask: list[int] = []
    for piece_ids, (_, flag) in zip(encoded, pieces, strict=True):
        input_ids.extend(piece_ids)
        loss_mask.extend([flag] * len(piece_ids))
    if not ids:  # a text tokenizer, a text conversation
        return TokenizedConversation(input_ids, loss_mask)
    return _expand_images(input_ids, loss_mask, images, tokens, ids, image_processor, base_dir, image_paths_outside)


# --------------------------------------------------------------------------------------------------------
# Packing


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


# --------------------------------------------------------------------------------------------------------
# Dataset and rank assignment


class PackedDataset(Dataset):
    """Map-style dataset of packed rows, deterministic given its inputs and ``seed``; ``dataset[i]`` is a
    :class:`PackedRow`.

    Rows are held as two int64 [num_rows, S] tensors, plus per-row lists of ``pixel_values`` / ``image_grid_thw``
    (None entries for rows without images) when any row has images. Build one with :meth:`build` (files) or
    :meth:`from_messages` (in-memory conversations); pick a dp rank's rows with :func:`rows_for_rank`.
    """

    def __init__(self, rows: Sequence[PackedRow], stats: PackStats, *, seq_len: int, seed: int = 0):
        if not rows:
            hint = ""
            if stats.dropped:
                hint = (
                    f"; all {stats.dropped} document(s) were longer than data.seq_len={seq_len} and "
                    "data.overlong='drop' dropped them: raise data.seq_len or set data.overlong='truncate'"
                )
            elif not stats.documents:
                hint = "; the data holds no conversation with any tokens"
            raise DataError(f"no packed rows: nothing to train on ({stats.summary()}){hint}")
        self.seq_len = seq_len
        self.seed = seed
        self.stats = stats
        self._input_ids = torch.stack([r.input_ids for r in rows])
        self._labels = torch.stack([r.labels for r in rows])
        self._seq_lens = [r.seq_lens for r in rows]
        self._padding = [r.padding for r in rows]
        self._loss_tokens = [r.num_loss_tokens for r in rows]
        with_images = any(r.image_grid_thw is not None for r in rows)
        self._pixel_values = [r.pixel_values for r in rows] if with_images else None
        self._image_grid_thw = [r.image_grid_thw for r in rows] if with_images else None

    def __len__(self) -> int:
        return len(self._seq_lens)

    def __getitem__(self, index: int) -> PackedRow:
        return PackedRow(
            input_ids=self._input_ids[index],
            labels=self._labels[index],
            seq_lens=self._seq_lens[index],
            padding=self._padding[index],
            num_loss_tokens=self._loss_tokens[index],
            pixel_values=None if self._pixel_values is None else self._pixel_values[index],
            image_grid_thw=None if self._image_grid_thw is None else self._image_grid_thw[index],
        )

    @classmethod
    def from_messages(
        cls,
        conversations: Iterable[Sequence[dict[str, Any]] | Conversation],
        tokenizer: Any,
        seq_len: int,
        *,
        seed: int = 0,
        overlong: Overlong = "truncate",
        pad_token_id: int | None = None,
        end_of_turn: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        skipped_malformed: int = 0,
        image_processor: Any = None,
        vision_tokens: VisionTokens | None = None,
        on_error: OnError = "raise",
        base_dir: str | os.PathLike | None = None,
        image_paths_outside: bool = False,
    ) -> PackedDataset:
        """Tokenize and pack conversations (message lists, or :class:`Conversation` from the loader).

        Image paths resolve against the folder of a :class:`Conversation`'s file, or ``base_dir`` (default: the
        working directory) for plain message lists. A conversation that cannot be tokenized (an unreadable image,
        a template that drops images, placeholder tokens in its text) raises, as :class:`DataError` naming the
        file and row for a :class:`Conversation`; with ``on_error="skip"`` it is skipped and counted in
        ``stats.skipped_malformed``."""
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        if pad_token_id is None:
            pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            if pad_token_id is None:
                raise ValueError("the tokenizer has neither a pad nor an eos token; pass pad_token_id")
        docs = []
        for item in conversations:
            loaded = isinstance(item, Conversation)
            messages = item.messages if loaded else validate_messages({"messages": item})
            try:
                docs.append(
                    tokenize_conversation(
                        tokenizer,
                        messages,
                        end_of_turn=end_of_turn,
                        chat_template_kwargs=chat_template_kwargs,
                        image_processor=image_processor,
                        base_dir=Path(item.source).parent if loaded else base_dir,
                        vision_tokens=vision_tokens,
                        image_paths_outside=image_paths_outside,
                    )
                )
            except ValueError as exc:
                if on_error == "skip":
                    skipped_malformed += 1
                    continue
                if loaded:
                    raise DataError(f"{item.source}: row {item.row_number}: {exc}") from exc
                raise
        rows, stats = pack_examples(docs, seq_len, pad_token_id=pad_token_id, overlong=overlong, seed=seed)
        return cls(rows, replace(stats, skipped_malformed=skipped_malformed), seq_len=seq_len, seed=seed)

    @classmethod
    def build(
        cls,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        tokenizer: Any,
        seq_len: int,
        *,
        seed: int = 0,
        overlong: Overlong = "truncate",
        on_error: OnError = "raise",
        pad_token_id: int | None = None,
        end_of_turn: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        image_processor: Any = None,
        vision_tokens: VisionTokens | None = None,
        group: dist.ProcessGroup | None = None,
        image_paths_outside: bool = False,
    ) -> PackedDataset:
        """Load, tokenize and pack local JSONL/Parquet files (see :func:`load_conversations`); images go through
        ``image_processor``, and image paths in a file are relative to its folder.

        Without ``group`` this process builds the dataset itself; since the result is deterministic, every
        process that builds it with the same arguments gets the same rows (so each CP rank of a group reads
        and tokenizes the same files once). With ``group`` (e.g. the CP group) only its rank 0 builds and
        ``torch.distributed.broadcast_object_list`` sends the result (images included) to the others (the
        tokenizer and image processor are unused there); an error on rank 0 is raised on every rank of the
        group, so no rank is left waiting.
        """
        kwargs = {
            "seed": seed,
            "overlong": overlong,
            "pad_token_id": pad_token_id,
            "end_of_turn": end_of_turn,
            "chat_template_kwargs": chat_template_kwargs,
            "image_processor": image_processor,
            "vision_tokens": vision_tokens,
            "on_error": on_error,
            "image_paths_outside": image_paths_outside,
        }

        def build_here() -> PackedDataset:
            loaded = load_conversations(paths, on_error=on_error)
            return cls.from_messages(loaded, tokenizer, seq_len, skipped_malformed=loaded.skipped, **kwargs)

        if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
            return build_here()
        payload: list[Any] = [None]
        error: BaseException | None = None
        if dist.get_rank(group) == 0:
            try:
                payload[0] = ("ok", build_here())
            except Exception as exc:
                error = exc
                payload[0] = ("error", _portable_error(exc))
        dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
        status, value = payload[0]
        if status == "ok":
            return value
        raise error if error is not None else value


def build_training_rows(cfg: Any, tokenizer: Any, *, image_processor: Any = None) -> tuple[Any, PackStats]:
    """The training rows and their stats for a run config (reads ``cfg.data``: ``path`` (or ``cfg.data_path``, the
    path with its default filled in), ``seq_len``, ``overlong``, ``on_error``, ``seed``, and ``cache_dir`` /
    ``num_proc`` / ``messages_column`` / ``split`` / ``subset`` when set): a
    :class:`sft_trainer.data_rows.StoreDataset` of best-fit-decreasing rows read from the token cache (built by
    local rank 0 of each node when missing), the same rows on every rank.
    ``image_processor`` is needed when the data has images (``data.processor``). Pick a dp replica's rows with
    :func:`rows_for_rank`; every CP rank must get the same rows."""
    from sft_trainer.data_rows import open_packed_store_distributed

    dataset = open_packed_store_distributed(
        getattr(cfg, "data_path", None) or cfg.data.path,
        tokenizer,
        cfg.data.seq_len,
        image_processor=image_processor,
        num_proc=getattr(cfg.data, "num_proc", 0) or None,
        **store_options(cfg.data),
    )
    return dataset, dataset.stats


def store_options(data: Any) -> dict[str, Any]:
    """The ``[data]`` settings that pick the token store and pack plan, beside the files, tokenizer, processor and
    seq_len: what a run and ``sft-train plan`` must both pass to find the same cache."""
    return {
        "seed": data.seed,
        "overlong": data.overlong,
        "on_error": data.on_error,
        "image_paths_outside": getattr(data, "image_paths_outside", False),
        "cache_dir": getattr(data, "cache_dir", None),
        "messages_column": getattr(data, "messages_column", None),
        "split": getattr(data, "split", None),
        "subset": getattr(data, "subset", None),
    }


def _portable_error(exc: Exception) -> Exception:
    """``exc`` if it pickles (to be raised on the other ranks), else a RuntimeError carrying its message."""
    note = " (raised on rank 0 of the group while building the dataset)"
    try:
        copy = pickle.loads(pickle.dumps(exc))
        if isinstance(copy, Exception) and len(copy.args) == 1 and isinstance(copy.args[0], str):
            copy.args = (copy.args[0] + note,)
        return copy
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}{note}")


def rows_for_rank(dataset: Dataset, dp_rank: int, dp_size: int, *, epoch: int = 0) -> Subset:
    """The rows of data-parallel replica ``dp_rank`` of ``dp_size``, for one epoch.

    Pass the *dp* coordinates, not the global rank: every CP rank of a replica gets the same rows (each then
    keeps its own shard of every row). Replicas get disjoint rows, the same number each (the last
    ``len(dataset) % dp_size`` rows of the epoch's order are left out, so no replica waits on another at the
    end of an epoch). Epoch 0 keeps the dataset's (already shuffled) order; later epochs permute it with
    ``(dataset.seed, epoch)``, identically on every rank.
    """
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"invalid dp rank {dp_rank} for dp={dp_size}")
    n = len(dataset)
    per_rank = n // dp_size
    if per_rank == 0:
        raise DataError(f"{n} packed row(s) cannot feed dp={dp_size} replicas; add data or lower seq_len")
    order = list(range(n))
    if epoch:
        random.Random(getattr(dataset, "seed", 0) * 1_000_003 + epoch).shuffle(order)
    return Subset(dataset, order[dp_rank : per_rank * dp_size : dp_size])
