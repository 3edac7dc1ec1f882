"""Training rows assembled on demand from a token store and its pack plan, and opening them on every rank.

::

    dataset = open_packed_store("chats.jsonl", tokenizer, seq_len=8192, seed=0, cache_dir=cache)
    row = dataset[i]                  # a PackedRow: input_ids/labels int64 [S], seq_lens, images processed now

A row is built from memory-mapped slices when it is asked for, so a rank's memory does not grow with the dataset;
its images are read and run through the image processor then (never kept). In a distributed job one process per
node (its lowest rank) tokenizes and packs while the others wait; every rank then maps the same files
(:func:`open_packed_store_distributed`).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from sft_trainer.data import store as data_store
from sft_trainer.data.conversations import IGNORE_INDEX, DataError, OnError, Overlong
from sft_trainer.data.dataset import _portable_error
from sft_trainer.data.images import VisionTokens, load_image
from sft_trainer.data.pack_plan import PackPlan, open_or_write_pack_plan, plan_key
from sft_trainer.data.packing import PackedRow, PackStats, no_rows_error
from sft_trainer.data.sources import needs_datasets, resolve_data_files
from sft_trainer.data.tokenize import default_num_proc, options_for_key, token_options, write_token_store

BUILD_TIMEOUT = timedelta(hours=12)
"""How long the other ranks wait for their node's builder to tokenize and pack."""


def _print(message: str) -> None:
    print(f"[sft-train] {message}", file=sys.stderr, flush=True)


class StoreDataset(Dataset):
    """Map-style dataset of packed rows read from a token store through a pack plan; ``dataset[i]`` is a
    :class:`~sft_trainer.data.PackedRow` (int64 tensors, images processed with ``image_processor``)."""

    def __init__(
        self,
        store: data_store.TokenStore,
        plan: PackPlan,
        *,
        pad_token_id: int,
        image_processor: Any = None,
        image_paths_outside: bool = False,
    ):
        if plan.stats.rows == 0:
            first_skipped = (store.manifest.get("skip_reasons") or ["(not recorded)"])[0]
            raise no_rows_error(plan.stats, plan.seq_len, first_skipped)
        if store.has_images and image_processor is None:
            raise DataError(
                f"{store.arrays['image_grid'].shape[0]} image(s) in the data but no image processor is set: train a "
                "Qwen3.5-VL model with data.processor naming its processor folder"
            )
        self.store, self.plan = store, plan
        self.seq_len, self.seed = plan.seq_len, plan.seed
        self.pad_token_id = pad_token_id
        self.image_processor = image_processor
        self.image_paths_outside = image_paths_outside
        # Files written from a datasets source resolve relative image paths against the source's folder.
        self._source_dirs = store.manifest.get("key_inputs", {}).get("options", {}).get("source_dirs", {})

    @property
    def stats(self) -> PackStats:
        return self.plan.stats

    @property
    def efficiency(self) -> float:
        return self.plan.efficiency

    @property
    def fingerprint(self) -> str:
        """The token store's and the pack plan's folder names: they change with anything that changes the rows."""
        return f"{self.store.path.name}/{self.plan.path.name}"

    def __len__(self) -> int:
        return self.plan.stats.rows

    def __getitem__(self, index: int) -> PackedRow:
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        index %= len(self)
        arrays, plan = self.store.arrays, self.plan
        docs = plan.row_docs[plan.row_offsets[index] : plan.row_offsets[index + 1]].tolist()
        ids = np.full(self.seq_len, self.pad_token_id, np.int64)
        labels = np.full(self.seq_len, IGNORE_INDEX, np.int64)
        lens, images, at = [], [], 0
        for doc in docs:
            start, take = int(arrays["doc_offsets"][doc]), int(plan.doc_take[doc])
            tokens = arrays["tokens"][start : start + take]
            ids[at : at + take] = tokens
            labels[at : at + take - 1] = np.where(arrays["loss_mask"][start + 1 : start + take] != 0, tokens[1:], -100)
            lens.append(take)
            at += take
            first, last = int(arrays["image_offsets"][doc]), int(arrays["image_offsets"][doc + 1])
            images += [(doc, i) for i in range(first, last) if arrays["image_spans"][i][1] <= take]
        padding = self.seq_len - at
        if padding:
            lens.append(padding)
        pixels, grids = self._images(images) if images else (None, None)
        labels_t = torch.from_numpy(labels)
        return PackedRow(
            input_ids=torch.from_numpy(ids),
            labels=labels_t,
            seq_lens=tuple(lens),
            padding=padding,
            num_loss_tokens=int((labels_t != IGNORE_INDEX).sum()),
            pixel_values=pixels,
            image_grid_thw=grids,
        )

    def _where(self, doc: int) -> str:
        source = self.store.manifest["sources"][int(self.store.arrays["doc_source"][doc])]
        return f"{source}: row {int(self.store.arrays['doc_row'][doc])}"

    def _images(self, images: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Read and process a row's images (in document order) and check they still have the stored grids."""
        arrays = self.store.arrays
        pictures = []
        for doc, i in images:
            ref = self.store.image_ref(i)
            source = self.store.manifest["sources"][int(arrays["doc_source"][doc])]
            base = Path(self._source_dirs.get(source) or Path(source).parent)
            size, mtime = arrays["image_stat"][i].tolist()
            if isinstance(ref, str) and size >= 0:
                path = Path(ref.removeprefix("file://"))
                stat = (path if path.is_absolute() else base / path).stat()
                if (stat.st_size, stat.st_mtime_ns) != (size, mtime):
                    raise DataError(
                        f"{self._where(doc)}: image {ref!r} changed after the data cache was built; delete the cache "
                        f"folder {self.store.path} to rebuild it"
                    )
            try:
                pictures.append(load_image(ref, base, self.image_paths_outside))
            except ValueError as exc:
                raise DataError(f"{self._where(doc)}: {exc}") from None
        # One processor call per document, as tokenization made them: batching images of several sizes in one
        # call does not give the same pixel values.
        all_pixels, all_grids = [], []
        for doc in dict.fromkeys(doc for doc, _ in images):
            picked = [k for k, (owner, _) in enumerate(images) if owner == doc]
            processed = self.image_processor(images=[pictures[k] for k in picked], return_tensors="pt")
            grids = torch.as_tensor(processed["image_grid_thw"]).to(torch.int64).reshape(-1, 3)
            expected = torch.from_numpy(np.stack([arrays["image_grid"][images[k][1]] for k in picked]))
            if not torch.equal(grids, expected):
                raise DataError(
                    f"{self._where(doc)}: the image processor now gives grids {grids.tolist()}, the data cache "
                    f"holds {expected.tolist()}; delete {self.store.path} to rebuild it"
                )
            all_pixels.append(torch.as_tensor(processed["pixel_values"]).to(torch.float32))
            all_grids.append(grids)
        return torch.cat(all_pixels), torch.cat(all_grids)


def _pad_id(tokenizer: Any, pad_token_id: int | None) -> int:
    if pad_token_id is not None:
        return pad_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad nor an eos token; pass pad_token_id")
    return pad


def _store_location(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    tokenizer: Any,
    *,
    cache_dir: str | os.PathLike | None,
    image_processor: Any,
    end_of_turn: str | None,
    chat_template_kwargs: Mapping[str, Any] | None,
    vision_tokens: VisionTokens | None,
    on_error: OnError,
    image_paths_outside: bool = False,
    messages_column: str | None = None,
    split: str | None = None,
    subset: str | None = None,
) -> tuple[list[Path], Path, dict[str, Any], dict[str, Any]]:
    """``(files, store folder, key inputs, worker options)`` of these files (or ``datasets`` source, see
    :mod:`sft_trainer.data.sources`) and settings."""
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    cache = Path(cache_dir) if cache_dir is not None else data_store.default_cache_dir()
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(
            f"token cache folder {cache} cannot be created ({exc.strerror}); set data.cache_dir (or "
            "SFT_TRAINER_CACHE) to a writable folder"
        ) from None
    files, labels, dirs = resolve_data_files(paths, cache, messages_column=messages_column, split=split, subset=subset)
    memo_path = cache / "file-digests.json"
    memo = data_store.load_memo(memo_path)
    options = token_options(
        end_of_turn=end_of_turn,
        chat_template_kwargs=chat_template_kwargs,
        vision_tokens=vision_tokens,
        on_error=on_error,
        image_paths_outside=image_paths_outside,
        messages_column=messages_column,
        source_labels=labels,
        source_dirs=dirs,
    )
    key, inputs = data_store.token_key(
        files, tokenizer, image_processor=image_processor, options=options_for_key(options), memo=memo
    )
    data_store.save_memo(memo_path, memo)
    return files, cache / f"tokens-{key}", inputs, options


def open_token_store(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    tokenizer: Any,
    *,
    cache_dir: str | os.PathLike | None = None,
    image_processor: Any = None,
    end_of_turn: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    vision_tokens: VisionTokens | None = None,
    on_error: OnError = "raise",
    image_paths_outside: bool = False,
    num_proc: int | None = None,
    log: Callable[[str], None] = _print,
    messages_column: str | None = None,
    split: str | None = None,
    subset: str | None = None,
) -> data_store.TokenStore:
    """The token store of these files and settings: reused when a complete one exists, else built with
    ``num_proc`` processes (default: every core); says which in one line through ``log``. ``messages_column``,
    ``split`` and ``subset``: see :mod:`sft_trainer.data.sources`."""
    files, final, inputs, options = _store_location(
        paths,
        tokenizer,
        cache_dir=cache_dir,
        image_processor=image_processor,
        end_of_turn=end_of_turn,
        chat_template_kwargs=chat_template_kwargs,
        vision_tokens=vision_tokens,
        on_error=on_error,
        image_paths_outside=image_paths_outside,
        messages_column=messages_column,
        split=split,
        subset=subset,
    )
    reason = "no cache for these files and settings yet"
    if final.exists():
        try:
            store = data_store.TokenStore.open(final)
            counts = store.manifest["counts"]
            log(f"data cache: reusing {final} ({counts['documents']} documents, {counts['tokens']} tokens)")
            return store
        except data_store.StoreError as exc:
            reason = f"the cache there is incomplete ({exc}); set aside as {data_store.set_aside(final).name}"
    procs = num_proc or default_num_proc()
    log(f"data cache: building {final} from {len(files)} file(s) with {procs} process(es) ({reason})")
    started = time.perf_counter()
    store = write_token_store(
        final, files, tokenizer, image_processor=image_processor, options=options, key_inputs=inputs, num_proc=procs
    )
    seconds = time.perf_counter() - started
    used = store.manifest["build"]["processes"]
    log(
        f"data cache: built {store.num_documents} documents, {store.num_tokens} tokens in {seconds:.1f} s "
        f"({store.num_tokens / max(seconds, 1e-9) / used:.0f} tokens/s per process, {used} process(es))"
    )
    return store


def open_packed_store(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    tokenizer: Any,
    seq_len: int,
    *,
    seed: int = 0,
    overlong: Overlong = "truncate",
    pad_token_id: int | None = None,
    image_processor: Any = None,
    **store_kwargs: Any,
) -> StoreDataset:
    """Tokenize (or reuse) and pack the files: a :class:`StoreDataset` of best-fit-decreasing rows."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    if overlong not in ("truncate", "drop"):
        raise ValueError(f"overlong must be 'truncate' or 'drop', got {overlong!r}")
    outside = bool(store_kwargs.get("image_paths_outside", False))
    store = open_token_store(paths, tokenizer, image_processor=image_processor, **store_kwargs)
    plan = open_or_write_pack_plan(store, seq_len, overlong=overlong, seed=seed)
    pad = _pad_id(tokenizer, pad_token_id)
    return StoreDataset(store, plan, pad_token_id=pad, image_processor=image_processor, image_paths_outside=outside)


def open_packed_store_distributed(
    paths: str | os.PathLike | Sequence[str | os.PathLike], tokenizer: Any, seq_len: int, **kwargs: Any
) -> StoreDataset:
    """Every rank maps the store and pack plan when all of them find both complete (a warm start). Otherwise
    :func:`open_packed_store` runs on the lowest rank of every node (host name) while the other ranks wait, which
    then map the store their node's builder wrote (the files and tokenizer are not read there). An error on any
    builder is raised on every rank (no rank waits forever)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return open_packed_store(paths, tokenizer, seq_len, **kwargs)
    complete = _complete_on_every_rank(paths, tokenizer, seq_len, kwargs)
    if complete is not None:  # a warm start: no group of its own (creating one costs about a second)
        return complete
    rank = dist.get_rank()
    # The waiting ranks sit in these collectives while their builder tokenizes, which may take far longer than the
    # default process group's timeout (NCCL: 10 minutes): they wait in a CPU group of their own with a long one.
    group = dist.new_group(backend="gloo", timeout=BUILD_TIMEOUT)
    hosts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    builder = hosts.index(hosts[rank])  # the node's lowest rank builds; its other ranks map what it wrote
    mine: tuple[str, Any] = ("idle", None)
    dataset: StoreDataset | None = None
    error: BaseException | None = None
    if builder == rank:
        try:
            dataset = open_packed_store(paths, tokenizer, seq_len, **kwargs)
            mine = ("ok", (str(dataset.store.path), str(dataset.plan.path)))
        except Exception as exc:
            error = exc
            mine = ("error", _portable_error(exc))
    statuses: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(statuses, mine, group=group)
    dist.destroy_process_group(group)
    failed = next((value for status, value in statuses if status == "error"), None)
    if failed is not None:
        raise error if error is not None else failed
    if dataset is not None:
        return dataset
    store_path, plan_path = statuses[builder][1]
    store = data_store.TokenStore.open(Path(store_path))
    plan = PackPlan.open(Path(plan_path))
    pad = _pad_id(tokenizer, kwargs.get("pad_token_id"))
    return StoreDataset(
        store,
        plan,
        pad_token_id=pad,
        image_processor=kwargs.get("image_processor"),
        image_paths_outside=bool(kwargs.get("image_paths_outside", False)),
    )


def _complete_on_every_rank(paths: Any, tokenizer: Any, seq_len: int, kwargs: Mapping[str, Any]) -> StoreDataset | None:
    """The packed store when every rank finds its token store and pack plan complete on disk (agreed in one
    collective on the default group), else None: then each node's builder builds what is missing. A ``datasets``
    source is left to the builders, which materialize it."""
    dataset = None
    try:
        if not (isinstance(paths, str | os.PathLike) and needs_datasets(str(paths))):
            dataset = _open_complete(paths, tokenizer, seq_len, **kwargs)
    except Exception:  # whatever it is, the builder meets it again and reports it
        dataset = None
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend()) else None
    found = torch.tensor([int(dataset is not None)], device=device)
    dist.all_reduce(found, op=dist.ReduceOp.MIN)
    return dataset if found.item() else None


def _open_complete(
    paths: Any,
    tokenizer: Any,
    seq_len: int,
    *,
    seed: int = 0,
    overlong: Overlong = "truncate",
    pad_token_id: int | None = None,
    image_processor: Any = None,
    num_proc: int | None = None,
    log: Callable[[str], None] = _print,
    **source: Any,
) -> StoreDataset:
    """:func:`open_packed_store`'s result from a complete store and pack plan, writing nothing; raises
    :class:`~sft_trainer.data.store.StoreError` when either is missing or incomplete."""
    defaults = {"cache_dir": None, "end_of_turn": None, "chat_template_kwargs": None, "vision_tokens": None}
    location = {**defaults, "on_error": "raise", **source}
    _, final, _, _ = _store_location(paths, tokenizer, image_processor=image_processor, **location)
    store = data_store.TokenStore.open(final)
    plan = PackPlan.open(final / f"pack-{plan_key(seq_len, overlong, seed)}")
    if dist.get_rank() == 0:
        counts = store.manifest["counts"]
        log(f"data cache: reusing {final} ({counts['documents']} documents, {counts['tokens']} tokens)")
    outside = bool(source.get("image_paths_outside", False))
    pad = _pad_id(tokenizer, pad_token_id)
    return StoreDataset(store, plan, pad_token_id=pad, image_processor=image_processor, image_paths_outside=outside)
