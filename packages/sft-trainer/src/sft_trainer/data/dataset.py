"""The in-memory packed dataset, the training rows of a run config and the rows of one data-parallel replica."""

from __future__ import annotations

import os
import pickle
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, Subset

from sft_trainer.data.chat import tokenize_conversation
from sft_trainer.data.conversations import (
    Conversation,
    DataError,
    OnError,
    Overlong,
    load_conversations,
    validate_messages,
)
from sft_trainer.data.images import VisionTokens
from sft_trainer.data.packing import PackedRow, PackStats, no_rows_error, pack_examples
from sft_trainer.data.render import ChatRenderer, ChatTemplateError, as_row_error


class PackedDataset(Dataset):
    """Map-style dataset of packed rows, deterministic given its inputs and ``seed``; ``dataset[i]`` is a
    :class:`PackedRow`.

    Rows are held as two int64 [num_rows, S] tensors, plus per-row lists of ``pixel_values`` / ``image_grid_thw``
    (None entries for rows without images) when any row has images. Build one with :meth:`build` (files) or
    :meth:`from_messages` (in-memory conversations); pick a dp rank's rows with :func:`rows_for_rank`.
    """

    def __init__(self, rows: Sequence[PackedRow], stats: PackStats, *, seq_len: int, seed: int = 0):
        if not rows:
            raise no_rows_error(stats, seq_len)
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
        renderer = ChatRenderer(tokenizer, chat_template_kwargs)
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
                        renderer=renderer,
                    )
                )
            except (ValueError, ChatTemplateError) as exc:
                if isinstance(exc, ChatTemplateError):  # re-raises the template's own failures
                    exc = as_row_error(exc, messages)
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
    :class:`sft_trainer.data.rows.StoreDataset` of best-fit-decreasing rows read from the token cache (built by
    local rank 0 of each node when missing), the same rows on every rank.
    ``image_processor`` is needed when the data has images (``data.processor``). Pick a dp replica's rows with
    :func:`rows_for_rank`; every CP rank must get the same rows."""
    from sft_trainer.data.rows import open_packed_store_distributed

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


class ReplicaRows:
    """The rows of data-parallel replica ``dp_rank`` in training order over all epochs: ``rows[p]`` is the replica's
    ``p``-th row, from epoch ``p // per_epoch`` of :func:`rows_for_rank` (reshuffled each epoch with the dataset's
    seed, the same count for every replica). A run's data position is ``p``, so a resumed run reads the same rows."""

    def __init__(self, dataset: Dataset, dp_rank: int, dp_size: int):
        self.dataset, self.dp_rank, self.dp_size = dataset, dp_rank, dp_size
        self._epoch = 0
        self._rows = rows_for_rank(dataset, dp_rank, dp_size, epoch=0)
        self.per_epoch = len(self._rows)

    def epoch_of(self, position: int) -> int:
        return position // self.per_epoch

    def index(self, position: int) -> int:
        """The dataset index of the replica's row at ``position``."""
        epoch, offset = divmod(position, self.per_epoch)
        if epoch != self._epoch:  # one permutation per epoch, kept while the run is in it
            self._rows, self._epoch = rows_for_rank(self.dataset, self.dp_rank, self.dp_size, epoch=epoch), epoch
        return self._rows.indices[offset]

    def __getitem__(self, position: int) -> Any:
        return self.dataset[self.index(position)]
