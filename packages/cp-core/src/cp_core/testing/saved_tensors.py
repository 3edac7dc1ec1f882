"""What autograd keeps for backward: the storages a run saves and their bytes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def saved_storages(run: Callable[[], Any]) -> tuple[Any, dict[int, int]]:
    """``run()``'s result and the storages autograd keeps for its backward, ``{data_ptr: nbytes}``: what a saved
    tensor costs, views of one storage counted once. Every packed tensor is held until ``run`` returns, so an
    address freed and reused inside the run is not mistaken for one storage."""
    storages: dict[int, int] = {}
    held = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        held.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = run()
    return result, storages
