"""What the token cache holds for some data and settings, found from their keys without tokenizing: the packing
``sft-train plan`` reports and the data fingerprint a checkpoint records."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sft_trainer.data import store as data_store
from sft_trainer.data.conversations import OnError, Overlong
from sft_trainer.data.pack_plan import open_or_write_pack_plan, plan_key
from sft_trainer.data.rows import _store_location


def _store_folder(
    paths: Any, tokenizer: Any, on_error: OnError, image_processor: Any, cache_dir: Any, source: Mapping[str, Any]
) -> Path:
    _, final, _, _ = _store_location(
        paths,
        tokenizer,
        cache_dir=cache_dir,
        image_processor=image_processor,
        end_of_turn=None,
        chat_template_kwargs=None,
        vision_tokens=None,
        on_error=on_error,
        **source,
    )
    return final


def cached_packing(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    tokenizer: Any,
    seq_len: int,
    *,
    seed: int = 0,
    overlong: Overlong = "truncate",
    on_error: OnError = "raise",
    image_processor: Any = None,
    cache_dir: str | os.PathLike | None = None,
    **source: Any,
) -> dict[str, Any]:
    """What packing these files gives, from the token cache, without tokenizing: ``{"cache": folder, "cached":
    bool}`` plus, when the store exists, ``efficiency`` and the :class:`~sft_trainer.data.PackStats` fields (the
    pack plan is written when missing, which takes seconds)."""
    final = _store_folder(paths, tokenizer, on_error, image_processor, cache_dir, source)
    try:
        store = data_store.TokenStore.open(final)
    except data_store.StoreError:
        return {"cache": str(final), "cached": False}
    plan = open_or_write_pack_plan(store, seq_len, overlong=overlong, seed=seed)
    return {"cache": str(final), "cached": True, "efficiency": plan.efficiency, **plan.stats.as_dict()}


def data_fingerprint(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    tokenizer: Any,
    seq_len: int,
    *,
    seed: int = 0,
    overlong: Overlong = "truncate",
    on_error: OnError = "raise",
    image_processor: Any = None,
    cache_dir: str | os.PathLike | None = None,
    **source: Any,
) -> str:
    """:attr:`StoreDataset.fingerprint` of these files and settings, from their keys alone (nothing is tokenized;
    the files are hashed unless the cache remembers their digests)."""
    final = _store_folder(paths, tokenizer, on_error, image_processor, cache_dir, source)
    return f"{final.name}/pack-{plan_key(seq_len, overlong, seed)}"
