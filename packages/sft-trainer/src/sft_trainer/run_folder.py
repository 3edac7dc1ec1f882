"""The folders a run writes: checked writable before any worker starts, held by one run at a time, and an earlier
run's outputs moved aside by a fresh run.

The hold is an ``fcntl.flock`` on ``output_dir/.sft-train.lock`` (and on a lock file beside ``checkpoint.dir`` when
that lies outside ``output_dir``), taken by the launcher (under torchrun: rank 0) for the life of its process.
The kernel drops a flock when its process ends, however it ends, so a crashed run never leaves a folder held;
the file itself stays and names the last holder. flock is per host: on network file systems that do not forward
it, two hosts are not kept apart.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import tempfile
import time
from pathlib import Path

LOCK_NAME = ".sft-train.lock"
_held: list[int] = []  # open lock descriptors: kept for the life of the process


def _first_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _folder_problem(field: str, value: str, folder: Path) -> str | None:
    """Why ``folder`` cannot be (created and) written, or None."""
    if folder.exists() and not folder.is_dir():
        return f"{field}={value!r}: {folder} is a file, not a folder; choose a folder path"
    base = _first_existing(folder)
    if not base.is_dir():
        return f"{field}={value!r}: {base} is a file, so {folder} cannot be created; choose another path"
    refused = _write_refused(base)
    if refused:
        what = f"is not writable ({refused})" if base == folder else f"cannot be created (in {base}: {refused})"
        return f"{field}={value!r}: {folder} {what}; choose a writable path"
    return None


def _write_refused(folder: Path) -> str | None:
    """Why a file cannot be created in ``folder`` (the OS's reason), or None. Tried, not inferred from the mode:
    root passes every permission check, yet a read-only mount or a kernel folder (/proc, /sys) refuses it."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return "permission denied"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".sft-train-write-check-", dir=folder))
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def output_problems(cfg) -> list[str]:
    """Each output path of ``cfg`` that this user cannot write, one line each (empty: all writable)."""
    problems = []
    if not str(cfg.output_dir).strip():
        problems.append(
            f"output_dir={cfg.output_dir!r}: must name a folder (the run's checkpoints, metrics and export go there)"
        )
        return problems
    problem = _folder_problem("output_dir", cfg.output_dir, Path(cfg.output_dir))
    if problem:  # the default checkpoint and metrics paths lie inside it: one mistake, one line
        return [problem]
    if cfg.checkpoint.dir:
        problem = _folder_problem("checkpoint.dir", cfg.checkpoint.dir, cfg.checkpoint_dir)
        if problem:
            problems.append(problem)
    export = Path(cfg.output_dir) / "hf"
    if cfg.checkpoint.export_hf and cfg.model.path and _same_folder(Path(cfg.model.path), export):
        problems.append(
            f"model.path={cfg.model.path!r} is where this run exports its weights ({export}): the export would "
            "overwrite the model it trains from; set another output_dir, or copy the model elsewhere first"
        )
    if not cfg.logging.metrics_file:
        return problems
    metrics = cfg.metrics_path
    field, value = "logging.metrics_file", cfg.logging.metrics_file
    if metrics.is_dir():
        problems.append(f"{field}={value!r}: {metrics} is a folder; name a file")
    elif metrics.exists() and _append_refused(metrics):
        problems.append(f"{field}={value!r}: {metrics} is not writable ({_append_refused(metrics)})")
    else:
        problem = _folder_problem(field, value, metrics.parent)
        if problem:
            problems.append(problem)
    return problems


def _same_folder(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and a.resolve() == b.resolve()
    except OSError:
        return False


def _append_refused(path: Path) -> str | None:
    """Why ``path`` (an existing file) cannot be opened to append to, or None (nothing is written)."""
    try:
        with open(path, "ab"):
            return None
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def lock_paths(cfg) -> list[Path]:
    out = Path(cfg.output_dir).resolve()
    paths = [out / LOCK_NAME]
    ckpt = cfg.checkpoint_dir.resolve()
    if not ckpt.is_relative_to(out):  # beside it, not inside: set_aside_previous_run may move the folder
        paths.append(ckpt.parent / f".{ckpt.name}{LOCK_NAME}")
    return paths


def hold_run_folders(cfg) -> None:
    """Hold ``output_dir`` (and a separate ``checkpoint.dir``) for this process, or raise SystemExit naming the run
    that holds it."""
    for path in lock_paths(cfg):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise SystemExit(
                f"sft-train: {path.parent} is in use by another run ({holder}); wait for it to end or stop it, or "
                "choose another output_dir / checkpoint.dir"
            ) from None
        os.ftruncate(fd, 0)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.pwrite(fd, json.dumps(record).encode(), 0)
        _held.append(fd)


def _read_holder(fd: int) -> str:
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {record['pid']} on {record['host']}, started {record['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its pid is not recorded yet"


def set_aside_previous_run(cfg) -> list[tuple[Path, Path]]:
    """A fresh run whose folders hold an earlier run's checkpoints, metrics or HF export moves them aside, to
    ``checkpoints.1``, ``metrics.1.jsonl``, ``hf.1`` (the first free number), so that nothing is lost and the runs
    never mix (an old ``step-000040`` beside the new run's ``latest``). Returns the moves made."""
    output_dir = Path(cfg.output_dir).resolve()
    read = [Path(p).resolve() for p in (cfg.model.path, cfg.data_path, cfg.tokenizer_path, cfg.data.processor) if p]
    candidates = [Path(p).resolve() for p in (cfg.checkpoint_dir, cfg.metrics_path, Path(cfg.output_dir) / "hf")]
    found = [
        p
        for p in dict.fromkeys(candidates)
        if ((p.is_dir() and any(p.iterdir())) or (p.is_file() and p.stat().st_size))
        and not output_dir.is_relative_to(p)  # never the run folder itself or a folder above it
        and not any(r.is_relative_to(p) for r in read)  # nor what this run reads (a model exported by the last one)
    ]
    found = [p for p in found if not any(p != q and p.is_relative_to(q) for q in found)]  # the outermost only
    if not found:
        return []

    def aside(path: Path, n: int) -> Path:
        return path.with_name(f"{path.stem}.{n}{path.suffix}")

    n = 1
    while any(aside(p, n).exists() for p in found):
        n += 1
    moves = [(p, aside(p, n)) for p in found]
    for old, new in moves:
        old.rename(new)
    listed = ", ".join(f"{old} -> {new.name}" for old, new in moves)
    print(
        f"[sft-train] an earlier run's outputs were here; moved aside: {listed} (checkpoint.resume = true continues "
        "a run instead)",
        flush=True,
    )
    return moves
