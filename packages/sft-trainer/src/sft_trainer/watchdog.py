"""Local workers that never hang the launcher: heartbeats the launcher watches, a collective timeout on every
rank, the first failure reported once, Ctrl-C forwarded, and every worker ended when one stops.

Each spawned worker runs a thread that stamps its slot of a shared array with ``time.monotonic()`` every second;
a worker that stops answering (SIGSTOP, or stuck in native code that holds the GIL) stops stamping, and after
``parallel.heartbeat_timeout_s`` the launcher ends the run naming it. A rank blocked in a collective keeps
stamping: ``parallel.collective_timeout_s`` (the process group's timeout) ends that one.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import wait
from typing import Any

import torch.multiprocessing as mp

BEAT_INTERVAL_S = 1.0
STOP_GRACE_S = 3.0  # after the first failure, how long the other workers get to end before SIGKILL


def shared_beats(world: int):
    """One float per worker, shared with the spawned processes (0: not started yet)."""
    return mp.get_context("spawn").Array("d", world, lock=False)


def start_beating(beats, rank: int) -> None:
    """Stamp ``beats[rank]`` every second from a daemon thread, for the life of this process; end the process
    when the launcher is gone (killed: its workers must not go on writing into a folder nobody holds)."""
    launcher = os.getppid()

    def beat() -> None:
        while True:
            if os.getppid() != launcher:
                print(f"sft-train: worker {rank}: the launcher (pid {launcher}) is gone; stopping", file=sys.stderr)
                os._exit(1)
            beats[rank] = time.monotonic()
            time.sleep(BEAT_INTERVAL_S)

    threading.Thread(target=beat, name="sft-train-heartbeat", daemon=True).start()


def collective_timeout(cfg) -> datetime.timedelta:
    return datetime.timedelta(seconds=cfg.parallel.collective_timeout_s)


def is_collective_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is a process group's timeout (gloo: "Timed out waiting ...", NCCL: "Watchdog caught
    collective operation timeout", the store: "timeout")."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(k in text for k in ("Timed out", "timed out", "operation timeout"))


def _end(processes: list, first: Any | None = None) -> None:
    """SIGTERM the live workers, then SIGKILL those still there after the grace (a stopped one needs it)."""
    for p in processes:
        if p.is_alive() and p is not first:
            p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
        p.join()


def run_workers(target, args: tuple, world: int, heartbeat_timeout_s: float) -> None:
    """Spawn ``world`` workers ``target(rank, *args, beats)`` and wait for them; raise SystemExit with one line
    when one fails, is killed, stops answering, or the launcher is interrupted (forwarded to the workers)."""
    beats = shared_beats(world)
    context = mp.start_processes(target, args=(*args, beats), nprocs=world, join=False, start_method="spawn")
    processes = context.processes
    running = {p.sentinel: rank for rank, p in enumerate(processes)}
    try:
        while running:
            for sentinel in wait(list(running), timeout=0.5):
                rank = running.pop(sentinel)
                process = processes[rank]
                process.join()
                if process.exitcode != 0:
                    _end(processes)
                    raise SystemExit(_exit_line(rank, process.exitcode))
            if heartbeat_timeout_s > 0:
                now = time.monotonic()
                for rank, process in enumerate(processes):
                    last = beats[rank]
                    if process.is_alive() and last > 0 and now - last > heartbeat_timeout_s:
                        _end(processes)
                        raise SystemExit(
                            f"sft-train: worker {rank} (pid {process.pid}) stopped answering: no heartbeat for "
                            f"{now - last:.0f} s (parallel.heartbeat_timeout_s={heartbeat_timeout_s:g}); every "
                            "worker was stopped (a process stopped by a signal, or stuck in native code)"
                        )
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        for p in processes:
            if p.is_alive():
                os.kill(p.pid, signal.SIGINT)
        deadline = time.monotonic() + 10.0
        for p in processes:
            p.join(max(0.0, deadline - time.monotonic()))
        _end(processes)
        print("sft-train: interrupted (SIGINT); every worker was stopped", file=sys.stderr)
        raise SystemExit(130) from None


def _exit_line(rank: int, code: int) -> str:
    if code < 0:  # killed, not stopped: say by what (SIGKILL is most often the out-of-memory killer)
        name = signal.Signals(-code).name
        hint = " (most often the out-of-memory killer: see dmesg)" if name == "SIGKILL" else ""
        return f"sft-train: worker {rank} was killed by {name}{hint}"
    return f"sft-train: stopped (worker {rank} exited with code {code})"
