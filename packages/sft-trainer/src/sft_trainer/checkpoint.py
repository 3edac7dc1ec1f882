"""Training checkpoints that hold only data: torch DCP shards for the model and optimizer, JSON and safetensors for
the trainer's own state, and loading that never runs code from the checkpoint folder.

A checkpoint ``step-NNNNNN/`` holds DCP's ``.metadata`` and ``__R_0.distcp`` shards, and per rank
``extra-rank{R}.json`` (step, the run's ``train.steps`` and ``grad_accum``, the data position, the LR scheduler's
state) and ``rng-rank{R}.safetensors`` (the CPU and CUDA generator states). Loading reads ``.metadata`` with an
unpickler that builds only DCP's metadata classes, torch dtypes/sizes/layouts and paths, and the non-tensor items
of the optimizer state with ``torch.load(weights_only=True)``; a file holding anything else is refused.
"""

from __future__ import annotations

import errno
import io
import json
import pickle
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

EXTRA_FORMAT = "sft-train extra state 1"


class CheckpointError(ValueError):
    """A checkpoint folder this run cannot read (the message names the file and the problem)."""


# ----------------------------------------------------------------------------------------------------------
# The trainer's own state: JSON + safetensors


def extra_path(path: Path, rank: int) -> Path:
    return path / f"extra-rank{rank}.json"


def rng_path(path: Path, rank: int) -> Path:
    return path / f"rng-rank{rank}.safetensors"


def write_extra_state(path: Path, rank: int, state: dict[str, Any], rng: dict[str, torch.Tensor]) -> None:
    """This rank's step, schedule and data position (JSON) and its generator states (safetensors)."""
    from safetensors.torch import save_file

    extra_path(path, rank).write_text(json.dumps({"format": EXTRA_FORMAT, **state}, indent=1))
    save_file({k: v.contiguous() for k, v in rng.items()}, str(rng_path(path, rank)))


def read_extra_state(path: Path, rank: int) -> dict[str, Any]:
    """The JSON state :func:`write_extra_state` wrote; raises :class:`CheckpointError` naming the file."""
    file = extra_path(path, rank)
    try:
        state = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{file}: not readable as sft-train's JSON state ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or state.get("format") != EXTRA_FORMAT:
        raise CheckpointError(f'{file}: not an sft-train state file (no "format": {EXTRA_FORMAT!r})')
    for key, least in (("step", 0), ("train_steps", 1), ("grad_accum", 1), ("world_size", 1)):
        if not isinstance(state.get(key), int) or isinstance(state.get(key), bool) or state[key] < least:
            raise CheckpointError(f"{file}: {key!r} must be an integer >= {least}, got {state.get(key)!r}")
    if not isinstance(state.get("scheduler"), dict):
        raise CheckpointError(f"{file}: 'scheduler' must be an object, got {state.get('scheduler')!r}")
    return state


def read_rng_state(path: Path, rank: int) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = rng_path(path, rank)
    try:
        state = load_file(str(file))
    except (OSError, SafetensorError) as exc:
        raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from None
    if "torch" not in state or state["torch"].dtype != torch.uint8:
        raise CheckpointError(f"{file}: no uint8 'torch' generator state in it")
    return state


def rng_state() -> dict[str, torch.Tensor]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    cuda = [state[f"cuda.{i}"] for i in range(len(state) - 1) if f"cuda.{i}" in state]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


# ----------------------------------------------------------------------------------------------------------
# DCP without unpickling: the metadata through an allow-list, the optimizer's non-tensor items weights-only

_DCP_MODULES = ("torch.distributed.checkpoint.metadata",)
_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes, torch dtypes, sizes and layouts and paths; refuses every other global."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = (module, name) in _ALLOWED_GLOBALS
        if module in _DCP_MODULES:
            obj = getattr(__import__(module, fromlist=[name]), name, None)
            allowed = isinstance(obj, type)  # the dataclasses and enums of DCP's metadata, not its functions
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = True
        if not allowed:
            raise pickle.UnpicklingError(f"refused global {module}.{name}")
        return super().find_class(module, name)


def read_dcp_metadata(path: Path):
    """DCP's ``.metadata`` of checkpoint ``path``, read through the allow-list; raises :class:`CheckpointError`."""
    file = path / ".metadata"
    try:
        with file.open("rb") as fh:
            return _MetadataUnpickler(fh).load()
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing (an incomplete checkpoint: resume from an earlier step)") from None
    except Exception as exc:
        raise CheckpointError(
            f"{file}: not torch DCP checkpoint metadata ({type(exc).__name__}: {exc}); it is not loaded"
        ) from None


def _dcp_reader_and_planner(path: Path):
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.planner import ReadItem

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            metadata = read_dcp_metadata(Path(self.path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            loaded = torch.load(value, weights_only=True)  # DefaultLoadPlanner's own, but weights-only
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return Reader(str(path)), Planner()


def dcp_load(state: dict[str, Any], path: Path) -> None:
    """``torch.distributed.checkpoint.load`` of ``state`` from ``path`` with nothing unpickled beyond plain data."""
    import torch.distributed.checkpoint as dcp

    reader, planner = _dcp_reader_and_planner(path)
    dcp.load(state, storage_reader=reader, planner=planner)


# ----------------------------------------------------------------------------------------------------------
# Saving, finding and checking checkpoints


def no_space(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it wraps, as DCP's CheckpointException does per rank) is a full disk."""
    seen: set[int] = set()
    todo: list[Any] = [exc]
    while todo:
        item = todo.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, OSError) and item.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(item):
            return True
        todo += [getattr(item, "__cause__", None), getattr(item, "__context__", None), getattr(item, "exc", None)]
        failures = getattr(item, "failures", None)
        if isinstance(failures, dict):
            todo += list(failures.values())
    return False


def save_checkpoint(ckpt_dir: Path, step: int, model, optimizer, scheduler, extra: dict[str, Any]) -> None:
    """torch.distributed.checkpoint of model and optimizer, plus each rank's step, scheduler and RNG as data.
    ``latest`` moves to the new step only once every rank has written all of it; a full disk stops the run with
    one line and leaves ``latest`` on the previous checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    path = ckpt_dir / f"step-{step:06d}"
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    failed = torch.zeros(2, device=device)  # [any error, a full disk]
    error: BaseException | None = None
    try:
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path))
        write_extra_state(path, rank, {"step": step, "scheduler": scheduler.state_dict(), **extra}, rng_state())
    except Exception as exc:
        error = exc
        failed = torch.tensor([1.0, float(no_space(exc))], device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed[0] > 0:
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)  # a partial step folder is never resumed; free its space
        latest = ckpt_dir / "latest"
        previous = f"latest still names {latest.read_text().strip()}" if latest.is_file() else "no earlier one"
        if rank != 0 and (failed[1] > 0 or error is None):  # rank 0 says it once; the launcher ends the rest
            time.sleep(2.0)
            raise SystemExit(1)
        if failed[1] > 0:
            raise SystemExit(
                f"sft-train: no space left on the device while saving checkpoint {path} (checkpoint.dir); the "
                f"incomplete step was removed and {previous}: free space or set checkpoint.dir elsewhere, then "
                "resume with checkpoint.resume = true"
            )
        if error is not None:
            raise error
        raise SystemExit(f"sft-train: another rank failed to save checkpoint {path}; {previous}")
    dist.barrier()
    if rank == 0:
        tmp = ckpt_dir / "latest.tmp"
        tmp.write_text(path.name)
        tmp.replace(ckpt_dir / "latest")


def resume_checkpoint(cfg) -> Path | None:
    """The checkpoint this run continues from: ``checkpoint.resume`` as a path, or with true the latest under
    ``checkpoint_dir``; None for a fresh start (also true with no checkpoint yet)."""
    resume = cfg.checkpoint.resume
    if not resume:
        return None
    if isinstance(resume, str) and resume not in ("true", "latest"):
        return Path(resume)
    latest = cfg.checkpoint_dir / "latest"
    if not latest.exists():
        return None
    try:
        return cfg.checkpoint_dir / latest.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"{latest}: not readable as the name of a step folder ({type(exc).__name__}); write the step-NNNNNN "
            "folder to resume into it, or name that folder in checkpoint.resume"
        ) from None


def check_resume(cfg, world: int) -> list[str]:
    """Why the checkpoint to resume from cannot continue this run (empty: it can, or the run starts fresh): it must
    be an sft-train checkpoint with every rank's state readable as data, written by as many ranks as this run has
    (each holds its rank's random state) in the same dp x cp layout, with the same ``train.steps``, ``grad_accum``
    and schedule settings (the LR schedule and the data order), and DCP metadata that reads through the
    allow-list."""
    try:
        path = resume_checkpoint(cfg)
    except CheckpointError as exc:
        return [f"checkpoint.resume: {exc}"]
    if path is None:
        return []
    if not path.is_dir():
        return [f"checkpoint.resume: {path} is not a folder (a checkpoint is a step-NNNNNN folder)"]
    if not extra_path(path, 0).is_file():
        pickled = (
            " (it holds extra-rank0.pt, a pickle, which sft-train never loads)"
            if (path / "extra-rank0.pt").exists()
            else ""
        )
        return [f"checkpoint.resume: {path} is not an sft-train checkpoint (no extra-rank0.json in it){pickled}"]
    ranks = [p.stem.removeprefix("extra-rank") for p in path.glob("extra-rank*.json")]
    present = {int(r) for r in ranks if r.isdigit()}
    try:
        written_by = read_extra_state(path, 0)["world_size"]
    except CheckpointError as exc:
        return [f"checkpoint.resume: {exc}"]
    missing = [r for r in range(written_by) if r not in present]
    if missing:
        names = ", ".join(extra_path(path, r).name for r in missing[:4]) + (", ..." if len(missing) > 4 else "")
        return [f"checkpoint.resume: {path} is incomplete: {names} missing (resume from an earlier step)"]
    ranks = len(present)
    if ranks != world:
        return [
            f"checkpoint.resume: {path} was written by {ranks} rank(s) and this run has {world} (dp x cp); resume "
            "with the layout that wrote it, or start fresh (checkpoint.resume = false)"
        ]
    problems = []
    try:
        states = [read_extra_state(path, r) for r in range(world)]
        for r in range(world):
            read_rng_state(path, r)
        shards = shard_problems(path, read_dcp_metadata(path))
    except CheckpointError as exc:
        return [f"checkpoint.resume: {exc}"]
    if shards:
        return [f"checkpoint.resume: {path} is incomplete: {shards} (resume from an earlier step)"]
    state = states[0]
    for key in ("step", "train_steps", "grad_accum", "world_size"):
        other = next((r for r in range(1, world) if states[r][key] != state[key]), None)
        if other is not None:  # files of different saves mixed into one folder
            return [
                f"checkpoint.resume: {path} is inconsistent: {extra_path(path, other).name} has {key}="
                f"{states[other][key]} and {extra_path(path, 0).name} {key}={state[key]}; resume from another step"
            ]
    train = cfg.train
    if state["train_steps"] != train.steps:
        problems.append(
            f"checkpoint.resume: {path} was trained with train.steps={state['train_steps']} and this run sets "
            f"train.steps={train.steps}, which would change its learning-rate schedule; resume with train.steps="
            f"{state['train_steps']}, or start a new run from its HF export (model.path)"
        )
    if state["grad_accum"] != train.grad_accum:
        problems.append(
            f"checkpoint.resume: {path} was trained with train.grad_accum={state['grad_accum']} and this run sets "
            f"{train.grad_accum}, which would change the data order; resume with train.grad_accum={state['grad_accum']}"
        )
    problems += _settings_changes(cfg, path, state, world)
    if state["step"] > train.steps:
        problems.append(f"checkpoint.resume: {path} is at step {state['step']}, past train.steps={train.steps}")
    return problems


def resume_settings(cfg, dp: int, cp: int) -> dict[str, dict[str, Any]]:
    """The settings a checkpoint records for a resume to match, by part: the dp x cp layout (at the same rank count
    another one hands each rank other rows), the LR schedule's shape (the scheduler's saved state keeps its step,
    not these) and the optimizer's settings (AdamW's saved param groups would override a change)."""
    train = cfg.train
    return {
        "layout": {"dp": dp, "cp": cp},
        "schedule": {"warmup_steps": train.warmup_steps, "decay": train.decay, "min_lr_ratio": train.min_lr_ratio},
        "optimizer": {"lr": train.lr, "betas": list(train.betas), "weight_decay": train.weight_decay},
    }


def _settings_changes(cfg, path: Path, state: dict[str, Any], world: int) -> list[str]:
    """One line per recorded part (:func:`resume_settings`) this run changes; a part a checkpoint does not record
    passes. A checkpoint without the optimizer's record is held to its schedule's base lr."""
    ours = resume_settings(cfg, world // cfg.parallel.cp, cfg.parallel.cp)
    optimizer = state.get("optimizer")
    if not isinstance(optimizer, dict):
        base_lrs = state["scheduler"].get("base_lrs")
        optimizer = {"lr": base_lrs[0]} if isinstance(base_lrs, list) and base_lrs else {}
    parts = (
        ("optimizer", optimizer, "train", "which the optimizer's saved state would override"),
        ("layout", state.get("layout"), "parallel", "which would change which rows each rank reads"),
        ("schedule", state.get("schedule"), "train", "which would change its learning-rate schedule"),
    )
    problems = []
    for part, recorded, section, consequence in parts:
        if not isinstance(recorded, dict):
            continue
        changed = [key for key, value in ours[part].items() if key in recorded and recorded[key] != value]
        if changed:
            was = ", ".join(f"{section}.{key}={recorded[key]!r}" for key in changed)
            now = ", ".join(f"{section}.{key}={ours[part][key]!r}" for key in changed)
            problems.append(
                f"checkpoint.resume: {path} was trained with {was} and this run sets {now}, {consequence}; resume "
                f"with {was}, or start a new run from its HF export (model.path)"
            )
    return problems


def data_change_problem(cfg, fingerprint: str) -> str | None:
    """Why the checkpoint to resume from does not fit data of ``fingerprint`` (None: it does, the run starts fresh,
    the checkpoint records no fingerprint, or ``checkpoint.allow_data_change`` is set): its data position counts
    rows of the data it was trained on."""
    path = resume_checkpoint(cfg)
    if path is None or cfg.checkpoint.allow_data_change or not extra_path(path, 0).is_file():
        return None
    recorded = read_extra_state(path, 0).get("data_fingerprint")
    if recorded is None or recorded == fingerprint:
        return None
    return (
        f"checkpoint.resume: {path} was trained on data with fingerprint {recorded} and this run's data has "
        f"{fingerprint} (the files, tokenizer, chat template or data.seq_len/seed/overlong changed); resume with "
        "the data it was trained on, or set checkpoint.allow_data_change = true to continue on the new data"
    )


def shard_problems(path: Path, metadata) -> str:
    """The DCP data files the metadata names that are missing or shorter than it says ('' when none)."""
    needed: dict[str, int] = {}
    for info in getattr(metadata, "storage_data", {}).values():
        name = str(info.relative_path)
        needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    missing = [n for n in sorted(needed) if not (path / n).is_file()]
    short = [n for n in sorted(needed) if n not in missing and (path / n).stat().st_size < needed[n]]
    parts = [f"{', '.join(missing)} missing"] if missing else []
    parts += [f"{', '.join(short)} truncated"] if short else []
    return "; ".join(parts)


def maybe_resume(cfg, model, optimizer, scheduler) -> int:
    """Load the checkpoint :func:`resume_checkpoint` names into the model, optimizer, scheduler and RNG; returns
    its step (0: a fresh start). :func:`check_resume` has already read every file this reads."""
    path = resume_checkpoint(cfg)
    if path is None:
        if cfg.checkpoint.resume and dist.get_rank() == 0:
            print(
                f"[sft-train] checkpoint.resume: no checkpoint in {cfg.checkpoint_dir} yet; starting fresh", flush=True
            )
        return 0
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from sft_trainer.job_failure import one_line
    from sft_trainer.watchdog import is_collective_timeout

    rank = dist.get_rank()
    try:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp_load(state, path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        extra = read_extra_state(path, rank)
        scheduler.load_state_dict(extra["scheduler"])
        set_rng_state(read_rng_state(path, rank))
    except (Exception, CheckpointException) as exc:  # another model or LoRA setting than wrote it, or altered files
        if is_collective_timeout(exc):
            raise
        if isinstance(exc, CheckpointException) and exc.failures:  # DCP's: each rank's error with its traceback
            exc = next(iter(exc.failures.values()))[0]
        raise CheckpointError(
            f"checkpoint.resume: {path} does not load into this run ({one_line(exc, 400)}); resume with the model and "
            "train.lora settings that wrote it, or start fresh (checkpoint.resume = false)"
        ) from None
    if rank == 0:
        print(f"[sft-train] resumed from {path} at step {extra['step']}", flush=True)
    return int(extra["step"])
