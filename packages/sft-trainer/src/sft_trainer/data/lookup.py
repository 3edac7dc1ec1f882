"""What the token cache holds for some data and settings, found from their keys without tokenizing: the packing
``sft-train plan`` reports and the data fingerprint a checkpoint records (:func:`locate_store`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sft_trainer.data import store as data_store
from sft_trainer.data.conversations import OnError, Overlong
from sft_trainer.data.pack_plan import open_or_write_pack_plan, plan_key
from sft_trainer.data.rows import _store_location


@dataclass(frozen=True)
class StoreLocation:
    """Where the token cache keeps the store of some data files and settings, and the pack plan's key."""

    folder: Path
    seq_len: int
    overlong: Overlong
    seed: int

    @property
    def fingerprint(self) -> str:
        """:attr:`StoreDataset.fingerprint` of these files and settings, from their keys alone."""
        return f"{self.folder.name}/pack-{plan_key(self.seq_len, self.overlong, self.seed)}"

    def packing(self) -> dict[str, Any]:
        """What packing these files gives, from the token cache, without tokenizing: ``{"cache": folder,
        "cached": bool}`` plus, when the store exists, ``efficiency`` and the :class:`~sft_trainer.data.PackStats`
        fields (the pack plan is written when missing, which takes seconds)."""
        try:
            store = data_store.TokenStore.open(self.folder)
        except data_store.StoreError:
            return {"cache": str(self.folder), "cached": False}
        plan = open_or_write_pack_plan(store, self.seq_len, overlong=self.overlong, seed=self.seed)
        return {"cache": str(self.folder), "cached": True, "efficiency": plan.efficiency, **plan.stats.as_dict()}


def locate_store(
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
) -> StoreLocation:
    """The store these files and settings map to, found from their keys without tokenizing (the files are hashed
    unless the cache remembers their digests)."""
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
    return StoreLocation(final, seq_len, overlong, seed)
