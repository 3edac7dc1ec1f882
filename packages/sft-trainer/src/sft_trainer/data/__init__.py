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
rows: :func:`rows_for_rank` takes the *dp* coordinates only; :class:`ReplicaRows` strings its epochs together
(reshuffled with the seed) so that a run's data position picks each step's rows. Building is deterministic, so
every process may build the dataset itself (each reads and tokenizes the whole file once); pass ``group=`` to
:meth:`PackedDataset.build` to have rank 0 of that group build it and broadcast it to the others instead.

Modules: :mod:`~sft_trainer.data.conversations` (the message schema, JSONL/Parquet readers),
:mod:`~sft_trainer.data.sources` (other forms: another column, ShareGPT turns, HF ``datasets`` folders and hub
ids), :mod:`~sft_trainer.data.images` (placeholder tokens, reading images, the processor),
:mod:`~sft_trainer.data.chat` (template rendering and the loss mask), :mod:`~sft_trainer.data.packing` (packed
rows, greedy in-memory packing), :mod:`~sft_trainer.data.dataset` (:class:`PackedDataset`, the training rows of a
config, the rows of a dp replica). :class:`PackedDataset` holds its rows in memory; training
(:func:`build_training_rows`) reads them from the on-disk token cache instead: :mod:`~sft_trainer.data.store`
(the store), :mod:`~sft_trainer.data.tokenize` (parallel tokenization), :mod:`~sft_trainer.data.pack_plan`
(best-fit-decreasing pack plans) and :mod:`~sft_trainer.data.rows` (rows assembled per index, images processed
lazily).
"""

import importlib
from typing import Any

# name -> module, imported on first use: a tokenizing worker process imports sft_trainer.data.tokenize, which
# needs neither torch (the dataset, packing) nor anything else of the training stack
_EXPORTS = {
    **dict.fromkeys(("TokenizedConversation", "assistant_spans", "tokenize_conversation"), "sft_trainer.data.chat"),
    **dict.fromkeys(
        (
            "IGNORE_INDEX",
            "ROLES",
            "Conversation",
            "DataError",
            "LoadedConversations",
            "OnError",
            "Overlong",
            "load_conversations",
            "tiny_chat_path",
            "tiny_tokenizer_dir",
            "tiny_vl_chat_path",
            "tiny_vl_processor_dir",
            "validate_messages",
        ),
        "sft_trainer.data.conversations",
    ),
    **dict.fromkeys(
        ("PackedDataset", "ReplicaRows", "build_training_rows", "rows_for_rank", "store_options"),
        "sft_trainer.data.dataset",
    ),
    "ChatTemplateError": "sft_trainer.data.render",
    **dict.fromkeys(
        ("VisionTokens", "conversation_images", "load_image", "load_image_processor", "load_processor"),
        "sft_trainer.data.images",
    ),
    **dict.fromkeys(
        ("PackedRow", "PackResult", "PackStats", "collate_packed", "pack_examples"), "sft_trainer.data.packing"
    ),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'sft_trainer.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
