"""``sft-torchrun`` (or ``python -m sft_trainer.torchrun``): torchrun's launcher run in this process, with
torch.distributed.run's own argument parser and elastic agent, for a run on one host or several. A failure reaches
the user as one line, once, per host: this launcher says it, where plain torchrun adds its own failure summary
to each rank's line.

``sft-torchrun [torchrun options] [sft-train arguments]``: ``--config`` and every ``--section.key`` (or
``--output_dir``) with its value go to sft-train, the rest to torchrun (``--nproc-per-node``, ``--nnodes``,
``--node-rank``, ``--rdzv-endpoint``, ``--standalone``, ...); the training script is always ``sft_trainer.run``.
The config and the output folders are checked here, before any worker starts.

Each worker reports into a private folder (``job_failure.LAUNCHER_DIR_ENV``): the first failure of the job
(claimed in the rendezvous store, so one rank of the whole job speaks) and the store's address. A thread here
reads the store: the job's first failure (which may come from another host), and the ``abort`` record a rank
writes when it sees a peer stop answering; a frozen worker of this host is then killed (SIGKILL: a stopped
process ignores torchrun's SIGTERM), so every host ends within the heartbeat timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from sft_trainer.job_failure import LAUNCHER_DIR_ENV, key_prefix

USAGE = (
    "usage: sft-torchrun [torchrun options] [--config FILE.toml] [--section.key VALUE ...]\n\n"
    "Runs sft-train under torchrun's elastic agent in this process (one command per host), and prints a failure\n"
    "as one line, once. torchrun options: --nproc-per-node N, --standalone (one host), or --nnodes N --node-rank R\n"
    "--rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID (several hosts), ... (`torchrun --help`); the\n"
    "script is always sft_trainer.run. The sft-train arguments are those of `sft-train --help`. Set\n"
    "SFT_TRAIN_TORCHRUN_LOGS=1 to see torchrun's own log lines."
)
POLL_S = 0.25  # how often the watcher reads the store
FAILED_GRACE_S = 5.0  # once the job has failed, how long this host's workers get to end by themselves
_SCRIPT_OPTIONS = ("-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path")


def split_arguments(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(torchrun's options, sft-train's arguments). A token ``--NAME[=VALUE]`` belongs to sft-train when NAME is
    ``config`` or starts with a config section or key (``train.lr``, ``output_dir``); the tokens after an option
    that are not options themselves (its value) go with it."""
    from sft_trainer.config import TrainConfig

    trainer_roots = {*TrainConfig.model_fields, "config"}
    launcher, trainer = [], []
    current = launcher
    for token in argv:
        if token.startswith("--"):
            root = token[2:].split("=", 1)[0].split(".", 1)[0]
            current = trainer if root in trainer_roots else launcher
        elif token.startswith("-") and len(token) > 1 and not token[1].isdigit():
            current = launcher  # torchrun's short options (-r, -t)
        current.append(token)
    return launcher, trainer


def main(argv: Sequence[str] | None = None) -> None:
    from sft_trainer.cli import checked_config, wants_help

    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_help(argv):
        print(USAGE)
        return
    launcher_args, trainer_args = split_arguments(argv)
    script = [a for a in launcher_args if a.split("=", 1)[0] in _SCRIPT_OPTIONS]
    if script:
        raise SystemExit(f"sft-torchrun: {script[0]}: the script is always sft_trainer.run; drop {script[0]}")
    args = _torchrun_args(launcher_args, trainer_args)
    checked_config(trainer_args)  # a mistake in the config is said here, before any worker starts
    if not os.environ.get("SFT_TRAIN_TORCHRUN_LOGS"):
        logging.disable(logging.ERROR)  # torchrun's agent logs each failure; the line below says it once
    with tempfile.TemporaryDirectory(prefix="sft-torchrun-") as folder:
        os.environ[LAUNCHER_DIR_ENV] = folder
        watcher = StoreWatcher(Path(folder))
        watcher.start()
        try:
            raise SystemExit(_run(args, watcher))
        finally:
            watcher.stop()
            os.environ.pop(LAUNCHER_DIR_ENV, None)
            logging.disable(logging.NOTSET)


def _torchrun_args(launcher_args: list[str], trainer_args: list[str]):
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "sft-torchrun"

    def error(message: str):  # argparse's usage block would bury the line
        raise SystemExit(f"sft-torchrun: {message} (sft-torchrun --help; torchrun --help lists its options)")

    parser.error = error
    return parser.parse_args([*launcher_args, "-m", "sft_trainer.run", *trainer_args])


def _run(args, watcher: StoreWatcher) -> int | str:
    """Run the job; the exit: 0, or the line that says how it failed."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    try:
        run(args)
        return 0
    except ChildFailedError as exc:
        return failure_line(exc.failures, watcher.failure())
    except (KeyboardInterrupt, SignalException) as exc:
        name = exc.sigval.name if isinstance(exc, SignalException) else "SIGINT"
        print(f"sft-train: interrupted ({name}); every worker of this host was stopped", file=sys.stderr)
        return 130
    except Exception as exc:  # the rendezvous (a wrong endpoint, a host that never joined) or the agent
        said = watcher.failure()
        if said:  # the job failed on another host, whose agent then closed the rendezvous under this one
            return f"{said} [this host: its workers were stopped after the job failed ({type(exc).__name__})]"
        return f"sft-torchrun: {type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"


def failure_line(failures: dict, said: str | None) -> str:
    """One line: the job's first failure as its rank said it (else how this host's first worker ended), and the
    ranks of this host that failed."""
    ranks = ", ".join(_ended(rank, f.exitcode) for rank, f in sorted(failures.items()))
    if said:
        return f"{said} [this host: {ranks}]"
    rank, first = min(failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    if first.exitcode < 0:
        name = signal.Signals(-first.exitcode).name
        hint = " (most often the out-of-memory killer: see dmesg)" if name == "SIGKILL" else ""
        return f"sft-train: rank {rank} was killed by {name}{hint} [this host: {ranks}]"
    return f"sft-train: stopped ({ranks})"


def _ended(rank: int, code: int) -> str:
    if code < 0:
        return f"rank {rank} killed by {signal.Signals(-code).name}"
    return f"rank {rank} exited with code {code}"


class StoreWatcher:
    """Reads the job's store from a thread: keeps the job's first failure, and kills this host's workers that
    another rank saw stop answering (then marks them ``ended``, which that rank waits for)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.said: str | None = None
        self.failed_at: float | None = None
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="sft-torchrun-store", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=5 * POLL_S)

    def failure(self) -> str | None:
        """The job's first failure: from this host's worker that claimed it, else as read from the store."""
        with contextlib.suppress(OSError):
            return (self.folder / "failure").read_text()
        return self.said

    def _watch(self) -> None:
        store, restart = None, "0"
        while not self.stopping.wait(POLL_S):
            if store is None:
                store, restart = self._connect()
            elif self._read(store, restart) is False:  # the store is gone (its host's agent ended)
                store = None
                with contextlib.suppress(OSError):
                    (self.folder / "store").unlink()
            if self.failed_at is None and self.failure() is not None:
                self.failed_at = time.monotonic()
            if self.failed_at is not None and time.monotonic() - self.failed_at > FAILED_GRACE_S:
                self._end_workers()  # a worker that outlives the job (frozen, or stuck where no error reaches it)

    def _connect(self):
        import torch.distributed as dist

        try:
            host, port, restart = (self.folder / "store").read_text().split()
            store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=5))
        except (OSError, ValueError, RuntimeError):
            return None, "0"
        return store, restart

    def _read(self, store, restart: str) -> bool:
        """Read the job's failure and abort records; False when the store is gone."""
        prefix = key_prefix(restart)
        try:
            if self.said is None and store.check([f"{prefix}failure"]):
                self.said = store.get(f"{prefix}failure").decode()
            if not store.check([f"{prefix}abort"]):
                return True
            for entry in store.get(f"{prefix}abort").decode().split(";"):
                rank, pid, host, parent = entry.split()
                if host == socket.gethostname() and int(parent) == os.getpid():  # a worker of this launcher
                    with contextlib.suppress(OSError):  # already gone
                        os.kill(int(pid), signal.SIGKILL)
                    store.set(f"{prefix}ended/{rank}", "1")
        except Exception:
            return False
        return True

    def _end_workers(self) -> None:
        for path in self.folder.glob("worker-*"):
            with contextlib.suppress(OSError, ValueError):
                pid = int(path.read_text())
                if _parent(pid) == os.getpid():
                    os.kill(pid, signal.SIGKILL)


def _parent(pid: int) -> int | None:
    """The parent of process ``pid`` (Linux /proc), or None when it is gone or unknown."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


if __name__ == "__main__":
    main()
