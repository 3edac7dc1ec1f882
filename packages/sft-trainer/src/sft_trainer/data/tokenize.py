"""Tokenize data files into a token store (:mod:`sft_trainer.data.store`), in parallel processes.

The files are cut into chunks (byte ranges of whole lines for JSONL, row groups for Parquet); each chunk is read,
validated, rendered and tokenized by one worker process and written as one shard; the shards are then copied, in
file and row order, into the store's flat arrays. The result does not depend on the number of processes: every row
is tokenized alone, and the order is the files' order.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sft_trainer.data import store as data_store
from sft_trainer.data.chat import (
    ConversationPieces,
    _default_end_of_turn,
    conversation_pieces,
    encode_texts,
    finish_conversation,
    plain_text,
)
from sft_trainer.data.conversations import (
    _JSONL_SUFFIXES,
    _MAX_REPORTED,
    _PARQUET_SUFFIXES,
    DataError,
    OnError,
    _jsonl_rows,
    _parquet_rows,
    validate_messages,
)
from sft_trainer.data.images import VisionTokens, conversation_images
from sft_trainer.data.render import ChatRenderer, ChatTemplateError, as_row_error
from sft_trainer.data.shard import Shard, image_reference
from sft_trainer.data.sources import open_parquet, parquet_column, row_messages

_MIN_CHUNK_BYTES = 1 << 18
_MAX_CHUNK_BYTES = 1 << 25
_BATCH_CHARS = 1 << 18  # text tokenized in one call: about 150k tokens of the tiny tokenizer


@dataclass(frozen=True)
class Chunk:
    """Rows of one file for one worker: bytes ``[start, end)`` of a JSONL file, or row groups ``[start, end)`` of a
    Parquet file; ``first_row`` is the 1-based number of its first line or row."""

    index: int
    source: int
    path: str
    parquet: bool
    start: int
    end: int
    first_row: int


@dataclass
class ChunkResult:
    index: int
    documents: int = 0
    tokens: int = 0
    images: int = 0
    image_ref_bytes: int = 0
    skipped: int = 0
    skip_reasons: list[str] = field(default_factory=list)
    error: str | None = None
    """The first malformed row's message when ``on_error="raise"`` (the chunk stops there)."""


def default_num_proc() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def plan_chunks(files: Sequence[Path], num_proc: int, messages_column: str | None = None) -> list[Chunk]:
    """Chunks of about ``total bytes / (16 * num_proc)`` (within 256 KiB to 32 MiB), cut at line starts: many per
    process, so that processes slowed by other work on the cores still finish close together."""
    total = sum(f.stat().st_size for f in files)
    target = min(_MAX_CHUNK_BYTES, max(_MIN_CHUNK_BYTES, total // max(1, 16 * num_proc)))
    chunks: list[Chunk] = []
    for source, path in enumerate(files):
        if path.suffix in _PARQUET_SUFFIXES:
            parquet, _ = open_parquet(path, messages_column)
            first = 1
            for group in range(parquet.num_row_groups):
                chunks.append(Chunk(len(chunks), source, str(path), True, group, group + 1, first))
                first += parquet.metadata.row_group(group).num_rows
            continue
        if path.suffix not in _JSONL_SUFFIXES:
            raise DataError(f"{path}: unsupported data file type {path.suffix!r}; use .jsonl or .parquet")
        size = path.stat().st_size
        if size == 0:
            continue
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            start, line = 0, 1
            while start < size:
                newline = view.find(b"\n", min(size, start + target) - 1)
                end = size if newline < 0 else newline + 1
                chunks.append(Chunk(len(chunks), source, str(path), False, start, end, line))
                line += view[start:end].count(b"\n")
                start = end
    return chunks


# --------------------------------------------------------------------------------------------------------
# One chunk (in a worker process, or in this one)

_STATE: dict[str, Any] = {}


def _init_worker(tokenizer: Any, image_processor: Any, options: Mapping[str, Any], out_dir: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    if image_processor is not None:  # its torch ops: one thread (text data never imports torch here)
        import torch

        torch.set_num_threads(1)
    _set_state(tokenizer, image_processor, options, out_dir)


def _set_state(tokenizer: Any, image_processor: Any, options: Mapping[str, Any], out_dir: str) -> None:
    options = dict(options)
    if options["end_of_turn"] is None:  # resolved once here, not once per row (it reads the whole vocabulary)
        options["end_of_turn"] = _default_end_of_turn(tokenizer)
    renderer = ChatRenderer(tokenizer, options["chat_template_kwargs"])  # the template prepared once per process
    _STATE.update(
        tokenizer=tokenizer, image_processor=image_processor, options=options, out_dir=out_dir, renderer=renderer
    )


def tokenize_chunk(chunk: Chunk) -> ChunkResult:
    """Validate and tokenize the rows of ``chunk`` and save them as ``chunk-<index>.npz`` in the output folder.

    Rows are rendered one by one and tokenized in batches of about ``_BATCH_CHARS`` characters: one tokenizer
    call for many conversations costs less than one each (every text is still tokenized alone)."""
    tokenizer, processor, options = _STATE["tokenizer"], _STATE["image_processor"], _STATE["options"]
    path = Path(chunk.path)
    where = options["source_labels"].get(chunk.path, chunk.path)  # a datasets source: its name, not the cache file
    base = Path(options["source_dirs"].get(chunk.path, path.parent))  # relative image paths start here
    rows = (
        _parquet_rows(
            path, range(chunk.start, chunk.end), chunk.first_row, parquet_column(path, options["messages_column"])
        )
        if chunk.parquet
        else _jsonl_rows(path, chunk.start, chunk.end, chunk.first_row)
    )
    result = ChunkResult(chunk.index)
    shard = Shard()
    batch: list[tuple[int, Any, ConversationPieces | Exception]] = []  # (row, messages, pieces or its error)
    chars = 0
    for number, row, problem in rows:
        try:
            if problem is not None:
                raise ValueError(problem)
            messages = validate_messages(row_messages(row, options["messages_column"]))
            pieces = conversation_pieces(
                tokenizer,
                messages,
                end_of_turn=options["end_of_turn"],
                chat_template_kwargs=options["chat_template_kwargs"],
                image_processor=processor,
                vision_tokens=options["vision_tokens"],
                renderer=_STATE["renderer"],
            )
        except (ValueError, OSError, ChatTemplateError) as exc:
            # a template error comes from rendering, after ``messages`` of this row are set; as_row_error re-raises
            # the template's own (sandbox refusals, the time limit)
            batch.append((number, None, as_row_error(exc, messages) if isinstance(exc, ChatTemplateError) else exc))
            if options["on_error"] == "raise":
                break
            continue
        batch.append((number, messages, pieces))
        chars += sum(map(len, pieces.texts))
        if chars >= _BATCH_CHARS:
            if not _tokenize_batch(batch, shard, result, base, where):
                batch = []
                break
            batch, chars = [], 0
    _tokenize_batch(batch, shard, result, base, where)
    result.documents, result.tokens, result.images = shard.documents, shard.tokens, shard.images
    result.image_ref_bytes = len(shard.refs)
    shard.save(Path(_STATE["out_dir"]) / f"chunk-{chunk.index:06d}.npz")
    return result


def _tokenize_batch(
    batch: list[tuple[int, Any, ConversationPieces | Exception]],
    shard: Shard,
    result: ChunkResult,
    base: Path,
    where: str,
) -> bool:
    """Tokenize the rendered rows of ``batch`` in one call and add them to ``shard`` in row order, recording the
    rows that failed; False once a failure stops the chunk (``on_error="raise"``)."""
    tokenizer, processor, options = _STATE["tokenizer"], _STATE["image_processor"], _STATE["options"]
    rendered = [pieces for _, _, pieces in batch if isinstance(pieces, ConversationPieces)]
    try:
        flat = encode_texts(tokenizer, [text for pieces in rendered for text in pieces.texts])
    except (ValueError, OSError):  # some row's text: tokenized row by row below, to tell which
        flat = None
    at = 0
    for number, messages, pieces in batch:
        try:
            if isinstance(pieces, Exception):
                raise pieces
            if flat is None:
                encoded = encode_texts(tokenizer, pieces.texts)
            else:
                encoded, at = flat[at : at + len(pieces.texts)], at + len(pieces.texts)
            if plain_text(pieces, encoded):
                shard.add_text(number, encoded, pieces.flags)
                continue
            doc = finish_conversation(pieces, encoded, processor, base, options["image_paths_outside"])
            images = [image_reference(image, base) for _, image in conversation_images(messages)]
        except (ValueError, OSError) as exc:
            message = f"{where}: row {number}: {exc}"
            if options["on_error"] == "raise":
                result.error = message
                return False
            result.skipped += 1
            if len(result.skip_reasons) < _MAX_REPORTED:
                result.skip_reasons.append(message)
            continue
        shard.add_document(number, doc, images)
    shard.convert()
    return True


# --------------------------------------------------------------------------------------------------------
# The whole store


def _run_chunks(chunks: list[Chunk], num_proc: int, init_args: tuple) -> list[ChunkResult]:
    """Every chunk's result in order; stops at the first chunk (in file order) that reports an error."""
    results: list[ChunkResult] = []
    if num_proc <= 1 or len(chunks) <= 1:
        saved = dict(_STATE)
        try:
            _set_state(*init_args)  # in-process: no thread cap
            for chunk in chunks:
                results.append(tokenize_chunk(chunk))
                if results[-1].error:
                    break
        finally:
            _STATE.clear()
            _STATE.update(saved)
        return results
    context = multiprocessing.get_context("spawn")  # never fork a process that holds threads (gloo, torch)
    with ProcessPoolExecutor(num_proc, mp_context=context, initializer=_init_worker, initargs=init_args) as pool:
        for result in pool.map(tokenize_chunk, chunks):
            results.append(result)
            if result.error:
                pool.shutdown(wait=True, cancel_futures=True)
                break
    return results


def _merge(tmp: Path, shards: Path, chunks: list[Chunk], results: list[ChunkResult]) -> dict[str, int]:
    """Copy the shards into the store's flat arrays, in chunk order, one shard in memory at a time."""
    counts = {
        "documents": sum(r.documents for r in results),
        "tokens": sum(r.tokens for r in results),
        "images": sum(r.images for r in results),
        "image_ref_bytes": sum(r.image_ref_bytes for r in results),
    }
    d, t, i, b = counts["documents"], counts["tokens"], counts["images"], counts["image_ref_bytes"]
    shapes = {
        "tokens": ((t,), np.int32),
        "loss_mask": ((t,), np.uint8),
        "doc_offsets": ((d + 1,), np.int64),
        "doc_source": ((d,), np.int32),
        "doc_row": ((d,), np.int64),
        "doc_loss": ((d,), np.int64),
        "image_offsets": ((d + 1,), np.int64),
        "image_spans": ((i, 2), np.int32),
        "image_grid": ((i, 3), np.int64),
        "image_stat": ((i, 2), np.int64),
        "image_kind": ((i,), np.uint8),
        "image_ref_offsets": ((i + 1,), np.int64),
        "image_refs": ((b,), np.uint8),
    }
    out = {
        name: np.lib.format.open_memmap(tmp / f"{name}.npy", mode="w+", dtype=dtype, shape=shape)
        for name, (shape, dtype) in shapes.items()
    }
    for name in ("doc_offsets", "image_offsets", "image_ref_offsets"):
        out[name][0] = 0
    at = dict.fromkeys(("tokens", "docs", "images", "refs"), 0)
    for result in results:
        shard = np.load(shards / f"chunk-{result.index:06d}.npz")
        nt, nd, ni = result.tokens, result.documents, result.images
        nb = result.image_ref_bytes
        t0, d0, i0, b0 = at["tokens"], at["docs"], at["images"], at["refs"]
        out["tokens"][t0 : t0 + nt] = shard["tokens"]
        out["loss_mask"][t0 : t0 + nt] = shard["loss_mask"]
        out["doc_offsets"][d0 + 1 : d0 + nd + 1] = t0 + np.cumsum(shard["doc_lens"])
        out["doc_source"][d0 : d0 + nd] = chunks[result.index].source
        out["doc_row"][d0 : d0 + nd] = shard["doc_row"]
        out["doc_loss"][d0 : d0 + nd] = shard["doc_loss"]
        out["image_offsets"][d0 + 1 : d0 + nd + 1] = i0 + np.cumsum(shard["doc_images"])
        for name in ("image_spans", "image_grid", "image_stat", "image_kind"):
            out[name][i0 : i0 + ni] = shard[name]
        out["image_ref_offsets"][i0 + 1 : i0 + ni + 1] = b0 + np.cumsum(shard["ref_lens"])
        out["image_refs"][b0 : b0 + nb] = shard["image_refs"]
        at.update(tokens=t0 + nt, docs=d0 + nd, images=i0 + ni, refs=b0 + nb)
        (shards / f"chunk-{result.index:06d}.npz").unlink()
    for array_ in out.values():
        array_.flush()
    return counts


def write_token_store(
    final: Path,
    files: Sequence[Path],
    tokenizer: Any,
    *,
    image_processor: Any,
    options: Mapping[str, Any],
    key_inputs: Mapping[str, Any],
    num_proc: int,
) -> data_store.TokenStore:
    """Tokenize ``files`` into the store folder ``final`` (written beside it, renamed into place when done).
    Raises :class:`DataError` for the first malformed row in file order when ``options["on_error"]`` is
    ``"raise"``."""
    started = time.perf_counter()
    tmp = data_store.temporary_sibling(final)
    try:
        chunks = plan_chunks(files, num_proc, options["messages_column"])
        shards = tmp / "shards"
        shards.mkdir()
        procs = max(1, min(num_proc, len(chunks)))
        results = _run_chunks(chunks, procs, (tokenizer, image_processor, dict(options), str(shards)))
        failed = next((r for r in results if r.error), None)
        if failed is not None:
            raise DataError(failed.error)
        counts = _merge(tmp, shards, chunks, results)
        shutil.rmtree(shards)
        seconds = time.perf_counter() - started
        reasons = [m for r in results for m in r.skip_reasons][:_MAX_REPORTED]
        data_store.write_manifest(
            tmp,
            {
                "format": data_store.STORE_FORMAT,
                "sources": [str(f.resolve()) for f in files],
                "counts": counts,
                "skipped": sum(r.skipped for r in results),
                "skip_reasons": reasons,
                "key_inputs": dict(key_inputs),
                "build": {"seconds": round(seconds, 3), "processes": procs, "chunks": len(chunks)},
            },
        )
        data_store.publish(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return data_store.TokenStore.open(final)


def token_options(
    *,
    end_of_turn: str | None,
    chat_template_kwargs: Mapping[str, Any] | None,
    vision_tokens: VisionTokens | None,
    on_error: OnError,
    image_paths_outside: bool = False,
    messages_column: str | None = None,
    source_labels: Mapping[str, str] | None = None,
    source_dirs: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The rendering options a worker needs (they are part of the store key: which image paths are accepted
    decides which rows are valid): ``source_labels`` and ``source_dirs`` map a file written from a ``datasets``
    source to the name its errors show and the folder its relative image paths start from (other files: their own
    name and folder)."""
    return {
        "end_of_turn": end_of_turn,
        "chat_template_kwargs": dict(chat_template_kwargs or {}),
        "vision_tokens": vision_tokens or VisionTokens(),
        "on_error": on_error,
        "image_paths_outside": image_paths_outside,
        "messages_column": messages_column,
        "source_labels": dict(source_labels or {}),
        "source_dirs": dict(source_dirs or {}),
    }


def options_for_key(options: Mapping[str, Any]) -> dict[str, Any]:
    return {**options, "vision_tokens": asdict(options["vision_tokens"])}
