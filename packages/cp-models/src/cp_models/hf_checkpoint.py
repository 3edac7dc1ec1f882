"""HF checkpoint folders: safetensors read and write, the key check, name rewrites, and the one loader behind
every model's ``from_pretrained``."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
import torch.nn as nn

from cp_core import ContextParallelError


def read_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a HF checkpoint folder (single file or sharded with an index)."""
    from safetensors.torch import load_file

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(str(path / name)))
    return state


def write_safetensors(
    state: Mapping[str, torch.Tensor], path: str | os.PathLike, max_shard_bytes: int = 5 * 2**30
) -> None:
    """Write ``state`` as HF safetensors (sharded with an index above ``max_shard_bytes``)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.detach().contiguous().cpu()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in state.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )


def check_checkpoint_keys(state: Mapping[str, torch.Tensor], expected: Iterable[str], path: str | os.PathLike) -> None:
    """Raise naming a few examples when a checkpoint lacks expected tensors or has unknown ones."""
    expected = set(expected)
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing:
        raise ContextParallelError(f"checkpoint {path} lacks {len(missing)} tensors, e.g. {sorted(missing)[:5]}")
    if unexpected:
        raise ContextParallelError(f"checkpoint {path} has unknown tensors, e.g. {sorted(unexpected)[:5]}")


def unwrapped_names(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with the name parts that activation-checkpoint and compile wrappers add removed (HF names)."""
    return {k.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""): v for k, v in state.items()}


def strip_prefixes(state: Mapping[str, torch.Tensor], prefixes: Iterable[tuple[str, str]]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state.items():
        for old, new in prefixes:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        out[name] = tensor
    return out


def load_hf_checkpoint(
    model: nn.Module,
    path: str | os.PathLike,
    to_ours: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    *,
    tied: tuple[str, str] | None = None,
    cast: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Assign the tensors of the checkpoint folder ``path`` to ``model`` (built on the meta device).

    ``to_ours`` rewrites the checkpoint's names into the model's; every tensor of ``model.state_dict()`` must be
    there and nothing else (:func:`check_checkpoint_keys`), except the tied head: ``tied`` = (head parameter,
    embedding parameter) names a head the checkpoint omits and that is tied to the embedding after loading.
    ``cast`` (name, tensor) -> tensor converts each tensor before it is assigned.
    """
    state = to_ours(read_safetensors(path))
    expected = set(model.state_dict().keys())
    if tied is not None:
        expected.discard(tied[0])
    check_checkpoint_keys(state, expected, path)
    if cast is not None:
        state = {name: cast(name, tensor) for name, tensor in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if tied is not None:
        head, embedding = (name.rsplit(".", 1) for name in tied)
        setattr(model.get_submodule(head[0]), head[1], model.get_parameter(".".join(embedding)))
