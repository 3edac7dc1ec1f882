"""How ``sft-train`` starts its local workers: forked from a server that imports a worker's modules while the
launcher checks the config, so that no worker imports torch, FSDP2 and transformers after the check.

The launcher owns one :class:`WorkerStart`: :meth:`WorkerStart.import_ahead` starts multiprocessing's fork server
with :data:`WORKER_MODULES` to preload; the server is no worker: it only imports, and :meth:`WorkerStart.stop`
ends it when the config is refused. A process that already holds torch (a program that embeds the trainer, a
harness that forks its workers), a torchrun worker, a GPU run (CUDA must not be initialised before a fork) and a
platform where a worker cannot watch a launcher that is not its parent spawn their workers instead. This module
imports nothing heavy: the launcher imports it first.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Any

# What a worker imports before its first step: torch and the trainer, the distributed-tensor stack FSDP2 needs
# (torch.distributed.fsdp; torch._dynamo, which fully_shard imports), transformers with its tokenizer classes,
# the data pipeline. (The checkpoint writer, torch.distributed.checkpoint, is first needed after the first step.)
WORKER_MODULES = (
    "sft_trainer.run",
    "torch.distributed.fsdp",
    "torch._dynamo",
    "transformers.models.auto.tokenization_auto",
    "transformers.tokenization_utils_tokenizers",
    "sft_trainer.data.dataset",
    "sft_trainer.tokenizer_fit",
    "sft_trainer.lora",
)


class WorkerStart:
    """The start method of one launcher's local workers: ``"forkserver"`` between :meth:`import_ahead` and
    :meth:`stop`, else ``"spawn"``. Always explicit: the interpreter's default start
    method (forkserver on Linux from Python 3.14) is never used."""

    def __init__(self) -> None:
        self.method = "spawn"

    def import_ahead(self) -> bool:
        """Start the fork server that imports :data:`WORKER_MODULES` beside this process; False (the workers will
        be spawned) where it would not pay or could not be stopped and watched."""
        if self.method == "forkserver":
            return True
        if "torch" in sys.modules or "RANK" in os.environ or not _can_watch_launcher():
            return False
        if _fork_server() is None or threading.current_thread() is not threading.main_thread():  # signal.signal
            return False  # below needs the main thread
        from multiprocessing import forkserver, resource_tracker

        forkserver.set_forkserver_preload(list(WORKER_MODULES))
        # The server starts with SIGINT ignored and blocked, and keeps both: Ctrl-C during its imports is the
        # launcher's alone to handle; one that comes meanwhile stays pending here and reaches the launcher's handler
        # once restored. The workers take Python's handler back (watchdog._worker_entry). The resource tracker
        # starts first: its start unblocks SIGINT, which would let a Ctrl-C in the window be discarded.
        resource_tracker.ensure_running()
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            forkserver.ensure_running()
        finally:
            signal.signal(signal.SIGINT, handler)
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        self.method = "forkserver"
        return True

    def stop(self) -> None:
        """End the fork server, if one started: the config was refused (no worker will start), or the run is on
        GPUs (CUDA does not survive a fork: its workers are spawned). Workers started after this are spawned."""
        if self.method == "forkserver":
            _stop_fork_server()
        self.method = "spawn"


def _can_watch_launcher() -> bool:
    """Whether a worker can see the launcher end when the launcher is not its parent (a forked worker's parent is
    the fork server): through a pidfd, Linux 5.3+ (``watchdog.start_beating``)."""
    fd = open_pidfd(os.getpid())
    if fd is None:
        return False
    os.close(fd)
    return True


def open_pidfd(pid: int) -> int | None:
    """A pidfd of process ``pid`` (readable once the process ends, whoever its parent is), or None where pidfds are
    not available; raises ProcessLookupError when ``pid`` has ended already. The one probe of pidfd support, so that
    the launcher forks its workers only where they can watch it."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:  # an OSError, but an answer: the process has ended
        raise
    except (AttributeError, OSError):  # no os.pidfd_open (not Linux), or the kernel or a sandbox refuses it
        return None


def _fork_server() -> Any | None:
    """multiprocessing's fork server of this process, or None where its private fields differ from CPython
    3.11-3.14's (``_forkserver``, its ``_forkserver_pid`` and ``_stop``): the standard library can start the
    server but neither names its pid nor stops it, and a refused config must not leave a server importing torch.
    This and :func:`_stop_fork_server` are the only places this package touches multiprocessing's private state;
    without it the workers are spawned."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    if not callable(getattr(server, "_stop", None)) or not hasattr(server, "_forkserver_pid"):
        return None
    return server


def _stop_fork_server() -> None:
    """SIGKILL the fork server (it may be in the middle of its imports, where closing its pipe does not reach it),
    then let multiprocessing reap it and forget it."""
    server = _fork_server()
    pid = getattr(server, "_forkserver_pid", None)
    if server is None or not isinstance(pid, int):
        return
    with contextlib.suppress(OSError):  # already gone
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):  # reaped elsewhere: forgotten all the same
        server._stop()
