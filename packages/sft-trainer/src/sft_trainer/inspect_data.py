"""``sft-train inspect-data``: the first packed rows of a run's data as text, with the tokens that carry loss marked.

It reads the data the way a run does (same config, same token cache, same pack plan) and starts no worker, so a
wrong chat template or loss mask shows before any GPU time is spent. Each row lists its documents (source file and
row, token count, truncation), the rendered text with the loss tokens marked (ANSI colour on a terminal,
``[[...]]`` otherwise), runs of image pad tokens as ``<image xN>`` and the row's padding as ``<pad xN>``; a last
line gives the packing statistics of the whole dataset.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from sft_trainer.data import IGNORE_INDEX, VisionTokens

LOSS_ON, LOSS_OFF = "\x1b[1;32m", "\x1b[0m"
"""ANSI bold green around loss tokens on a terminal."""
OPEN, CLOSE = "[[", "]]"
"""Brackets around loss tokens otherwise."""


def token_segments(ids: Sequence[int], loss: Sequence[bool], image_pad: int | None) -> list[tuple[str, list[int]]]:
    """Runs of tokens of one kind: ``("loss" | "text" | "image", ids)``; image pads never carry loss."""
    segments: list[tuple[str, list[int]]] = []
    for token, carries in zip(ids, loss, strict=True):
        kind = "image" if image_pad is not None and token == image_pad else ("loss" if carries else "text")
        if segments and segments[-1][0] == kind:
            segments[-1][1].append(token)
        else:
            segments.append((kind, [token]))
    return segments


def render_document(
    tokenizer: Any, ids: Sequence[int], loss: Sequence[bool], *, color: bool, image_pad: int | None = None
) -> str:
    """One document's text, loss tokens marked (colour or brackets), image pad runs as ``<image xN>``."""
    opened, closed = (LOSS_ON, LOSS_OFF) if color else (OPEN, CLOSE)
    parts = []
    for kind, run in token_segments(ids, loss, image_pad):
        if kind == "image":
            parts.append(f"<image x{len(run)}>")
            continue
        text = tokenizer.decode(run, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        parts.append(f"{opened}{text}{closed}" if kind == "loss" else text)
    return "".join(parts)


def render_row(dataset: Any, index: int, tokenizer: Any, *, color: bool) -> str:
    """Row ``index`` of a :class:`~sft_trainer.data.rows.StoreDataset`: a header, then each document's source,
    length and text. Token ``t`` of a document carries loss when ``labels[t - 1]`` is set (labels are shifted)."""
    row = dataset[index]
    store, plan = dataset.store, dataset.plan
    docs = plan.row_docs[plan.row_offsets[index] : plan.row_offsets[index + 1]].tolist()
    ids, labels = row.input_ids.tolist(), row.labels.tolist()
    image_pad = VisionTokens().ids(tokenizer).get("image_pad")
    lines = [
        f"=== row {index}: {len(docs)} document(s), {dataset.seq_len - row.padding} tokens + {row.padding} padding, "
        f"{row.num_loss_tokens} loss tokens ==="
    ]
    lengths = store.doc_lengths()
    names = store.manifest.get("key_inputs", {}).get("options", {}).get("source_labels", {})  # datasets sources
    at = 0
    for k, doc in enumerate(docs):
        take, full = int(plan.doc_take[doc]), int(lengths[doc])
        source = store.manifest["sources"][int(store.arrays["doc_source"][doc])]
        where = f"{names.get(source, source)}: row {int(store.arrays['doc_row'][doc])}"
        cut = f", truncated from {full}" if take < full else ""
        lines.append(f"--- document {k + 1}/{len(docs)} ({where}; {take} tokens{cut}) ---")
        doc_ids = ids[at : at + take]
        loss = [False] + [label != IGNORE_INDEX for label in labels[at : at + take - 1]]
        lines.append(render_document(tokenizer, doc_ids, loss, color=color, image_pad=image_pad))
        at += take
    if row.padding:
        lines.append(f"--- padding: <pad x{row.padding}> ---")
    return "\n".join(lines)


def stats_line(dataset: Any) -> str:
    """The packing statistics of the whole dataset in one line."""
    s = dataset.stats
    total = s.rows * dataset.seq_len
    return (
        f"packing: {s.rows} rows of {dataset.seq_len} tokens, {s.documents} documents, "
        f"{s.padding_tokens} padding tokens ({s.padding_tokens / total if total else 0:.2%}), "
        f"{s.loss_tokens} loss tokens, {s.truncated} truncated, {s.dropped} dropped, "
        f"{s.skipped_malformed} skipped as malformed, {s.no_loss_documents} without loss tokens"
    )


def inspect(cfg: Any, rows: int, color: bool, out: Any = None) -> Any:
    """Build (or reuse) the run's packed rows and print the first ``rows`` of them and the statistics to ``out``
    (default stdout); returns the dataset."""
    from sft_trainer.data import build_training_rows, load_image_processor
    from sft_trainer.tokenizer_fit import load_tokenizer

    out = out or sys.stdout
    tokenizer = load_tokenizer(cfg.tokenizer_path)
    processor = load_image_processor(cfg.processor_path) if cfg.vision_language and cfg.processor_path else None
    dataset, _ = build_training_rows(cfg, tokenizer, image_processor=processor)
    for index in range(min(rows, len(dataset))):
        print(render_row(dataset, index, tokenizer, color=color), file=out)
    print(stats_line(dataset), file=out, flush=True)
    return dataset
