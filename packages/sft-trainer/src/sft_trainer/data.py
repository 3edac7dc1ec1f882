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

**Loss mask.** 1 exactly on the tokens an assistant must generate: its content and the end-of-turn marker
(``<|im_end|>`` for ChatML), 0 on system/user messages and template text such as ``<|im_start|>assistant\\n``.
The chat template is rendered once for the whole conversation and once per assistant turn up to its generation
prompt; the assistant span starts where the generation prompt ends. The text is then tokenized in pieces cut at
the span boundaries, so a span's tokens are exactly what the model produces after the prompt at inference
(no token straddles a boundary, and the mask is exact by construction).

**Packing.** Documents (tokenized conversations) are shuffled with ``seed`` and concatenated greedily, in that
order, into rows of exactly ``seq_len`` tokens; a document that does not fit in the rest of a row starts the next
row and the rest is padding, a document of its own (pad ids, labels -100). Documents are never split across rows;
ones longer than ``seq_len`` are truncated to ``seq_len`` or dropped, and counted. A document may be far longer
than a CP shard (``seq_len / cp``): CP handles documents straddling shard cuts. ``labels[t]`` is the next token
``input_ids[t + 1]`` when ``t + 1`` lies in the same document and is a loss token, else -100, so labels are
already shifted and can be sharded with the input ids (``cp_core.shard_sequence``); the last token of every
document has label -100.

**Ranks.** All ranks of a CP group must train on the same rows, different data-parallel replicas on different
rows: :func:`rows_for_rank` takes the *dp* coordinates only. Building is deterministic, so every process may build
the dataset itself (each reads and tokenizes the whole file once); pass ``group=`` to :meth:`PackedDataset.build`
to have rank 0 of that group build it and broadcast it to the others instead.
"""

from __future__ import annotations

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
    "assistant_spans",
    "build_training_rows",
    "collate_packed",
    "load_conversations",
    "pack_examples",
    "rows_for_rank",
    "tiny_chat_path",
    "tiny_tokenizer_dir",
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


class DataError(ValueError):
    """A data row (or file) is malformed; the message names the file, the 1-based row and the problem."""


# --------------------------------------------------------------------------------------------------------
# Loading


class Conversation(NamedTuple):
    """One conversation and where it came from; unpacks as ``(source, row_number, messages)``."""

    source: str
    row_number: int
    """1-based row in ``source`` (for JSONL: the line number)."""
    messages: list[dict[str, str]]


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


def validate_messages(row: Any) -> list[dict[str, str]]:
    """The ``messages`` of one row as ``[{"role", "content"}]``; raises ``ValueError`` saying what is wrong."""
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
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string, got {type(content).__name__}")
        clean.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in clean):
        raise ValueError("no assistant message: the conversation has nothing to learn")
    return clean


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


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    """``(line_number, row, problem)`` for every non-blank line (``problem`` set when it is not valid JSON)."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
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


def _parquet_rows(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:
        raise DataError(f"{path}: cannot read as Parquet ({exc})") from exc
    names = parquet.schema_arrow.names
    if "messages" not in names:
        raise DataError(f"{path}: no 'messages' column (columns: {names})")
    number = 0
    for batch in parquet.iter_batches(batch_size=1024, columns=["messages"]):
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
# Tokenizing


class TokenizedConversation(NamedTuple):
    """Token ids of one rendered conversation and its loss mask (1 on assistant reply tokens)."""

    input_ids: list[int]
    loss_mask: list[int]

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool, kwargs: Mapping) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs)
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, expected str")
    return text


def _default_end_of_turn(tokenizer: Any) -> str | None:
    vocab = tokenizer.get_vocab()
    if "<|im_end|>" in vocab:
        return "<|im_end|>"
    return tokenizer.eos_token


def assistant_spans(
    tokenizer: Any,
    messages: list[dict[str, str]],
    *,
    end_of_turn: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans ``[start, end)`` of its assistant replies.

    A span starts where the generation prompt of the conversation so far ends and runs to the end of the
    reply's content plus the ``end_of_turn`` marker that follows it (when only whitespace lies between).
    Empty replies get no span. Raises ``ValueError`` if the template is not prefix-stable (the conversation
    up to a reply plus its generation prompt is not a prefix of the whole rendering).
    """
    kwargs = dict(chat_template_kwargs or {})
    if end_of_turn is None:
        end_of_turn = _default_end_of_turn(tokenizer)
    full = _render(tokenizer, messages, False, kwargs)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or not message["content"]:
            continue
        prefix = _render(tokenizer, messages[:i], True, kwargs)
        if not full.startswith(prefix):
            raise ValueError(
                f"the chat template is not prefix-stable at messages[{i}]: rendering the messages before it with "
                "add_generation_prompt=True is not a prefix of the whole conversation's rendering"
            )
        start = len(prefix)
        content = message["content"]
        found = full.find(content, start)
        if found < 0:  # templates that trim the reply
            content = content.strip()
            found = full.find(content, start) if content else start
        if found < 0:
            raise ValueError(f"the content of messages[{i}] (assistant) does not appear in the rendered template")
        end = found + len(content)
        if end_of_turn:
            marker = full.find(end_of_turn, end)
            if marker >= 0 and not full[end:marker].strip():
                end = marker + len(end_of_turn)
        if start < cursor:
            raise ValueError(f"the reply span of messages[{i}] overlaps the previous one")
        spans.append((start, end))
        cursor = end
    return full, spans


def tokenize_conversation(
    tokenizer: Any,
    messages: list[dict[str, str]],
    *,
    end_of_turn: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> TokenizedConversation:
    """Token ids of ``messages`` rendered with the tokenizer's chat template, and the assistant loss mask.

    ``loss_mask[t] == 1`` exactly on the tokens of assistant replies: content and the ``end_of_turn`` marker
    (default ``<|im_end|>`` when the vocabulary has it, else the eos token). Empty replies add no loss tokens.
    The text is tokenized in pieces cut at the reply boundaries (no special tokens added beyond the
    template's own), which is how a prompt and the reply generated after it are tokenized at inference.
    """
    full, spans = assistant_spans(
        tokenizer, messages, end_of_turn=end_of_turn, chat_template_kwargs=chat_template_kwargs
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
    for ids, (_, flag) in zip(encoded, pieces, strict=True):
        input_ids.extend(ids)
        loss_mask.extend([flag] * len(ids))
    return TokenizedConversation(input_ids, loss_mask)


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

    @property
    def num_documents(self) -> int:
        """Real documents in the row (padding excluded)."""
        return len(self.seq_lens) - (1 if self.padding else 0)

    _KEYS = ("input_ids", "labels", "seq_lens", "padding", "num_loss_tokens")

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

    ``examples`` are ``(input_ids, loss_mask)`` pairs. They are shuffled with ``random.Random(seed)`` (unless
    ``shuffle=False``) and filled greedily in that order; the result is a pure function of the inputs.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or pad_token_id < 0:
        raise ValueError(f"pad_token_id must be a non-negative int, got {pad_token_id!r}")
    if overlong not in ("truncate", "drop"):
        raise ValueError(f"overlong must be 'truncate' or 'drop', got {overlong!r}")
    docs = [(list(ids), list(mask)) for ids, mask in examples]
    for i, (ids, mask) in enumerate(docs):
        if len(ids) != len(mask):
            raise ValueError(f"example {i}: {len(ids)} input ids but {len(mask)} loss-mask values")
    order = list(range(len(docs)))
    if shuffle:
        random.Random(seed).shuffle(order)

    rows: list[PackedRow] = []
    counts = dict.fromkeys(("truncated", "dropped", "empty", "documents", "no_loss_documents"), 0)
    row_ids: list[int] = []
    row_labels: list[int] = []
    row_lens: list[int] = []

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
            )
        )
        row_ids.clear()
        row_labels.clear()
        row_lens.clear()

    for index in order:
        ids, mask = docs[index]
        if not ids:
            counts["empty"] += 1
            continue
        if len(ids) > seq_len:
            if overlong == "drop":
                counts["dropped"] += 1
                continue
            ids, mask = ids[:seq_len], mask[:seq_len]
            counts["truncated"] += 1
        if len(row_ids) + len(ids) > seq_len:
            flush()
        labels = _document_labels(ids, mask)
        if all(label == IGNORE_INDEX for label in labels):
            counts["no_loss_documents"] += 1
        row_ids.extend(ids)
        row_labels.extend(labels)
        row_lens.append(len(ids))
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


def collate_packed(rows: Sequence[PackedRow]) -> dict[str, Any]:
    """``DataLoader`` collate: ``input_ids``/``labels`` [B, S] and ``seq_lens`` (a tuple per row). CP needs B = 1."""
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

    Rows are held as two int64 [num_rows, S] tensors. Build one with :meth:`build` (files) or
    :meth:`from_messages` (in-memory conversations); pick a dp rank's rows with :func:`rows_for_rank`.
    """

    def __init__(self, rows: Sequence[PackedRow], stats: PackStats, *, seq_len: int, seed: int = 0):
        if not rows:
            raise DataError(f"no packed rows: nothing to train on ({stats.summary()})")
        self.seq_len = seq_len
        self.seed = seed
        self.stats = stats
        self._input_ids = torch.stack([r.input_ids for r in rows])
        self._labels = torch.stack([r.labels for r in rows])
        self._seq_lens = [r.seq_lens for r in rows]
        self._padding = [r.padding for r in rows]
        self._loss_tokens = [r.num_loss_tokens for r in rows]

    def __len__(self) -> int:
        return len(self._seq_lens)

    def __getitem__(self, index: int) -> PackedRow:
        return PackedRow(
            input_ids=self._input_ids[index],
            labels=self._labels[index],
            seq_lens=self._seq_lens[index],
            padding=self._padding[index],
            num_loss_tokens=self._loss_tokens[index],
        )

    @classmethod
    def from_messages(
        cls,
        conversations: Iterable[Sequence[dict[str, str]] | Conversation],
        tokenizer: Any,
        seq_len: int,
        *,
        seed: int = 0,
        overlong: Overlong = "truncate",
        pad_token_id: int | None = None,
        end_of_turn: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        skipped_malformed: int = 0,
    ) -> PackedDataset:
        """Tokenize and pack conversations (message lists, or :class:`Conversation` from the loader)."""
        if pad_token_id is None:
            pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            if pad_token_id is None:
                raise ValueError("the tokenizer has neither a pad nor an eos token; pass pad_token_id")
        docs = []
        for item in conversations:
            messages = item.messages if isinstance(item, Conversation) else validate_messages({"messages": item})
            try:
                docs.append(
                    tokenize_conversation(
                        tokenizer, messages, end_of_turn=end_of_turn, chat_template_kwargs=chat_template_kwargs
                    )
                )
            except ValueError as exc:
                if isinstance(item, Conversation):
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
        group: dist.ProcessGroup | None = None,
    ) -> PackedDataset:
        """Load, tokenize and pack local JSONL/Parquet files (see :func:`load_conversations`).

        Without ``group`` this process builds the dataset itself; since the result is deterministic, every
        process that builds it with the same arguments gets the same rows (so each CP rank of a group reads
        and tokenizes the same files once). With ``group`` (e.g. the CP group) only its rank 0 builds and
        ``torch.distributed.broadcast_object_list`` sends the result to the others (the tokenizer is unused
        there); an error on rank 0 is raised on every rank of the group, so no rank is left waiting.
        """
        kwargs = {
            "seed": seed,
            "overlong": overlong,
            "pad_token_id": pad_token_id,
            "end_of_turn": end_of_turn,
            "chat_template_kwargs": chat_template_kwargs,
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


def build_training_rows(
    cfg: Any, tokenizer: Any, *, group: dist.ProcessGroup | None = None
) -> tuple[list[PackedRow], PackStats]:
    """All packed rows and the stats for a run config (reads ``cfg.data``: ``path``, ``seq_len``, ``overlong``,
    ``on_error``, ``seed``), via :meth:`PackedDataset.build`. Pick a dp replica's rows with :func:`rows_for_rank`
    on ``PackedDataset`` or, on this list, ``rows[dp_rank::dp]``; every CP rank must get the same rows."""
    data = cfg.data
    dataset = PackedDataset.build(
        data.path,
        tokenizer,
        data.seq_len,
        seed=data.seed,
        overlong=data.overlong,
        on_error=data.on_error,
        group=group,
    )
    return [dataset[i] for i in range(len(dataset))], dataset.stats


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
