"""HF checkpoint folders: safetensors read and write, the key check, name rewrites, and the one loader behind
every model's ``from_pretrained``."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
import torch.nn as nn

from cp_core import ContextParallelError

PICKLE_WEIGHTS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt")


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a HF checkpoint folder: ``model.safetensors`` where it exists, else the shards its
    index names (transformers' order: a folder saved over an older sharded save may keep the old index). Raises
    FileNotFoundError or ValueError with one line naming what is missing or wrong; pickle weights are never read
    (unpickling can run code)."""
    path = Path(path)
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    index = path / "model.safetensors.index.json"
    if not index.exists():
        pickles = sorted({f.name for pattern in PICKLE_WEIGHTS for f in path.glob(pattern)})
        hint = (
            f"; it holds {', '.join(pickles)}: pickle weights, never loaded (unpickling can run code); save the "
            "model as safetensors (transformers' save_pretrained does by default)"
            if pickles
            else ""
        )
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}{hint}")
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{index} is not a safetensors index (a JSON object with a weight_map): {exc!r}") from None
    files = []
    for name in names:
        file = path / str(name)
        if not isinstance(name, str) or file.resolve().parent != path.resolve():
            raise ValueError(f"{index} names {name!r}, not a file in {path}")
        if not file.is_file():
            raise FileNotFoundError(f"{index} names {name}, which is missing")
        files.append(file)
    return files


def read_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a HF checkpoint folder (single file or sharded with an index)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        try:
            state.update(load_file(str(file)))
        except Exception as exc:  # safetensors' own error names neither the file nor the folder
            raise ValueError(f"{file}: {type(exc).__name__}: {exc}") from exc
    return state


def write_safetensors(
    state: Mapping[str, torch.Tensor], path: str | os.PathLike, max_shard_bytes: int = 5 * 2**30
) -> None:
    """Write ``state`` as HF safetensors (sharded with an index above ``max_shard_bytes``), then remove the weight
    files of an earlier save into ``path`` that this one did not rewrite (a stale index or shard would be read
    with, or instead of, the new weights)."""
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
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    written = {*names, "model.safetensors.index.json"} if len(shards) > 1 else set(names)
    stale = _weight_files(path) - written
    for fname, shard in zip(names, shards, strict=True):
        if (path / fname).is_symlink():  # a link into a hub cache: replace the link, never write through it
            (path / fname).unlink()
        save_file(shard, str(path / fname), metadata={"format": "pt"})
    if len(shards) > 1:
        weight_map = {name: fname for fname, shard in zip(names, shards, strict=True) for name in shard}
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = path / "model.safetensors.index.json"
        if index.is_symlink():
            index.unlink()
        index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    for name in stale:  # last: a save that dies before this point leaves the earlier save's other files in place
        (path / name).unlink()


def _weight_files(path: Path) -> set[str]:
    """The names of the safetensors weight files (and index) a save into ``path`` writes."""
    shard = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
    return {
        f.name
        for f in path.iterdir()
        if f.is_file() and (f.name in ("model.safetensors", "model.safetensors.index.json") or shard.fullmatch(f.name))
    }


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


def written_dtype(state: Mapping[str, torch.Tensor]) -> torch.dtype | None:
    """The dtype most of ``state``'s floating-point elements have: what a saved config names as its ``dtype`` (what
    transformers' ``dtype="auto"`` then loads in)."""
    sizes: dict[torch.dtype, int] = {}
    for tensor in state.values():
        if tensor.is_floating_point():
            sizes[tensor.dtype] = sizes.get(tensor.dtype, 0) + tensor.numel()
    return max(sizes, key=sizes.get) if sizes else None


def auto_dtype(config_dtype, state: Mapping[str, torch.Tensor]) -> torch.dtype | None:
    """transformers' ``dtype="auto"``: the config's dtype, else the checkpoint's first floating-point tensor's."""
    if isinstance(config_dtype, str):
        config_dtype = getattr(torch, config_dtype, None)
    if isinstance(config_dtype, torch.dtype):
        return config_dtype
    return next((t.dtype for t in state.values() if t.is_floating_point()), None)


def _tied_head(state: dict[str, torch.Tensor], head: str, embedding: str, path) -> dict[str, torch.Tensor]:
    """A tied checkpoint's head as transformers reads it: stored alone, it is the embedding; stored beside an equal
    embedding, the same tensor. A head that differs contradicts the config's tie."""
    if head not in state:
        return state
    if embedding not in state:
        state[embedding] = state.pop(head)
    elif torch.equal(state[head], state[embedding]):
        del state[head]
    else:
        raise ContextParallelError(
            f"checkpoint {path} sets tie_word_embeddings=true but stores a {head} that differs from its {embedding}: "
            f'set "tie_word_embeddings": false in its config.json to train the two apart, or drop {head} to tie them'
        )
    return state


def load_hf_checkpoint(
    model: nn.Module,
    path: str | os.PathLike,
    to_ours: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    *,
    tied: tuple[str, str] | None = None,
    dtype: torch.dtype | None = None,
    config_dtype: torch.dtype | str | None = None,
    keep_fp32: tuple[str, ...] = (),
) -> torch.dtype | None:
    """Assign the tensors of the checkpoint folder ``path`` to ``model`` (built on the meta device); returns the
    dtype its floating-point tensors took.

    ``to_ours`` rewrites the checkpoint's names into the model's; every tensor of ``model.state_dict()`` must be
    there and nothing else (:func:`check_checkpoint_keys`), except the tied head: ``tied`` = (head parameter,
    embedding parameter) names a head tied to the embedding after loading, which the checkpoint omits or stores
    equal to the embedding. Floating-point tensors take ``dtype``, or with None transformers' ``"auto"``
    (:func:`auto_dtype` of ``config_dtype``), as transformers loads every tensor in one dtype; names ending in
    ``keep_fp32`` take fp32 whatever the dtype.
    """
    state = to_ours(read_safetensors(path))
    expected = set(model.state_dict().keys())
    if tied is not None:
        state = _tied_head(state, *tied, path)
        expected.discard(tied[0])
    check_checkpoint_keys(state, expected, path)
    floating = {name for name, t in model.state_dict().items() if t.is_floating_point()}
    wrong = [
        f"{name} ({state[name].dtype})"
        for name in sorted(floating & state.keys())
        if not state[name].is_floating_point()
    ]
    if wrong:
        raise ContextParallelError(f"{path}: weights must be floating point; {', '.join(wrong[:3])} are not")
    dtype = dtype or auto_dtype(config_dtype, state)

    def cast(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_floating_point():
            return tensor
        return tensor.float() if keep_fp32 and name.endswith(keep_fp32) else tensor.to(dtype or tensor.dtype)

    model.load_state_dict({name: cast(name, tensor) for name, tensor in state.items()}, strict=False, assign=True)
    if tied is not None:
        head, embedding = (name.rsplit(".", 1) for name in tied)
        setattr(model.get_submodule(head[0]), head[1], model.get_parameter(".".join(embedding)))
    return dtype
