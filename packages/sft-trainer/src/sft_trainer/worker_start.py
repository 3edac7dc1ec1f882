"""How ``sft-train`` starts its local workers: forked from a server that imports a worker's modules while the
launcher checks the config, so that no worker imports torch, FSDP2 and transformers after the check.

:func:`import_ahead` starts multiprocessing's fork server with :data:`WORKER_MODULES` to preload; the server is
no worker: it only imports, and :func:`stop_importing` ends it when the config is refused. A process that already
holds torch (a program that embeds the trainer, a harness that forks its workers) starts none and its workers are
spawned. This module imports nothing heavy: the launcher imports it first.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

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

_importing = False


def import_ahead() -> bool:
    """Start the fork server that imports :data:`WORKER_MODULES` beside this process; False where it would not pay
    (torch is already imported here, or this process is a torchrun worker)."""
    global _importing
    if _importing:
        return True
    if "torch" in sys.modules or "RANK" in os.environ:
        return False
    from multiprocessing import forkserver

    forkserver.set_forkserver_preload(list(WORKER_MODULES))
    forkserver.ensure_running()
    _importing = True
    return True


def start_method() -> str:
    """The start method of the local workers: ``"forkserver"`` once :func:`import_ahead` started it, else
    ``"spawn"``."""
    return "forkserver" if _importing else "spawn"


def stop_importing() -> None:
    """End the fork server (the config was refused: no worker will start); a no-op when none was started."""
    global _importing
    if not _importing:
        return
    from multiprocessing import forkserver

    server = forkserver._forkserver
    pid = server._forkserver_pid
    if pid is not None:
        with contextlib.suppress(OSError):  # already gone
            os.kill(pid, signal.SIGKILL)
        server._stop()  # closes its pipe and reaps it
    _importing = False


def leave_with_launcher() -> None:
    """In a worker forked by the server: let go of the server's liveness pipe, which the server hands every child,
    so that the server ends when the launcher does and the worker's heartbeat thread sees its parent gone."""
    from multiprocessing import forkserver

    fd = forkserver._forkserver._forkserver_alive_fd
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
        forkserver._forkserver._forkserver_alive_fd = None
