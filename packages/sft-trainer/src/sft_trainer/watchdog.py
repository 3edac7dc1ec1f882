"""Local workers that never hang the launcher: heartbeats the launcher watches, a collective timeout on every
rank, the first failure reported once, Ctrl-C forwarded, and every worker ended when one stops.

Each spawned worker runs a thread that stamps its slot of a shared array with ``time.monotonic()`` every second;
a worker that stops answering (SIGSTOP, or stuck in native code that holds the GIL) stops stamping, and after
``parallel.heartbeat_timeout_s`` the launcher ends the run naming it. A rank blocked in a collective keeps
stamping: ``parallel.collective_timeout_s`` (the process group's timeout) ends that one.

Under torchrun no launcher of ours watches: each rank's thread counts its beats in a key of the rendezvous store
(torchrun's TCPStore) and reads its peers' counts; a peer whose count has not moved for the heartbeat timeout
is named in one line (by the first rank to see it), and the ranks that saw it leave (see ``PeerWatch``); under
``sft-torchrun`` each host's launcher kills its own frozen worker (see ``sft_trainer.torchrun``).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import torch.multiprocessing as mp

from sft_trainer.job_failure import STORE_ENV, ended, request_abort, say_once

BEAT_INTERVAL_S = 1.0
STOP_GRACE_S = 3.0  # after the first failure, how long the other workers get to end before SIGKILL
ABORT_WAIT_S = 5.0  # how long the rank that names a frozen peer waits for the launchers to kill it


def shared_beats(world: int):
    """One float per worker, shared with the spawned processes (0: not started yet)."""
    return mp.get_context("spawn").Array("d", world, lock=False)


LAUNCHER_ENV = "SFT_TRAIN_LAUNCHER"  # a local worker's environment: the launcher's pid


def start_beating(beats, rank: int) -> None:
    """Stamp ``beats[rank]`` every second from a daemon thread, for the life of this process; end the process
    when the launcher (pid in ``$SFT_TRAIN_LAUNCHER``) or this process's parent is gone (killed: its workers must
    not go on writing into a folder nobody holds). A worker forked by the fork server (``worker_start``) has the
    server as its parent, which outlives a killed launcher while its children run: the launcher is watched through
    a pidfd, which becomes readable when that process ends."""
    parent = os.getppid()
    launcher = int(os.environ.get(LAUNCHER_ENV, parent))
    launcher_ended = _end_watch(launcher) if launcher != parent else None

    def gone() -> bool:
        return os.getppid() != parent or (launcher_ended is not None and launcher_ended())

    def beat() -> None:
        while True:
            if gone():
                print(f"sft-train: worker {rank}: the launcher (pid {launcher}) is gone; stopping", file=sys.stderr)
                os._exit(1)
            beats[rank] = time.monotonic()
            time.sleep(BEAT_INTERVAL_S)

    threading.Thread(target=beat, name="sft-train-heartbeat", daemon=True).start()


def _end_watch(pid: int) -> Callable[[], bool] | None:
    """A function that says whether process ``pid`` has ended (its pidfd becomes readable then, whoever its parent
    is), or None where pidfds are not available (``worker_start`` then spawns: the parent is the launcher)."""
    from sft_trainer.worker_start import open_pidfd

    try:
        fd = open_pidfd(pid)
    except ProcessLookupError:  # it has ended already
        return lambda: True
    if fd is None:
        return None
    return lambda: bool(select.select([fd], [], [], 0)[0])


PEER_SILENT_S = 3 * BEAT_INTERVAL_S  # a peer is named in a collective timeout's line after this long without a beat


def _store_prefix() -> str:
    """Keys of this torchrun attempt (a restart starts counting afresh)."""
    return f"sft-train/heartbeat/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


class PeerWatch:
    """Under torchrun: this rank's beats in the rendezvous store and its view of the other ranks' beats.

    The process that starts the watch owns it: ``start`` it once, ask ``peers_that_stopped`` for a collective
    timeout's line, and ``stop`` it on the way out (a watch never started stops as a no-op)."""

    def __init__(self) -> None:
        self._silent: dict[int, float] = {}  # ranks seen silent: rank -> seconds since its last beat
        self._store: Any = None
        self._prefix = ""
        self._rank = -1
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, rank: int, world: int, heartbeat_timeout_s: float) -> None:
        """Beat into the rendezvous store and watch the other ranks' beats, from a daemon thread.

        Every second this rank adds 1 to its counter and reads every rank's; a peer whose counter has not moved for
        ``heartbeat_timeout_s`` (``> 0``) stopped answering. The first rank to see it says one line naming the
        silent rank(s), their pid and host; every rank that sees it has the silent ranks killed (SIGKILL: a stopped
        process ignores torchrun's SIGTERM) and exits with code 1, and torchrun ends the rest. Under sft-torchrun
        each host's launcher kills its own (``job_failure.request_abort``); under plain torchrun a rank kills those
        on its host. Peers silent for a few seconds are also kept for ``peers_that_stopped``, which a collective
        timeout's line names."""
        import torch.distributed as dist

        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=60),
        )
        prefix = _store_prefix()
        store.set(f"{prefix}who/{rank}", f"{os.getpid()} {socket.gethostname()} {os.getppid()}")  # ppid: its launcher
        stopping = self._stopping

        def beat() -> None:
            seen = [0] * world
            moved_at = [time.monotonic()] * world
            while not stopping.is_set():
                try:
                    store.add(f"{prefix}{rank}", 1)
                    counts = [store.add(f"{prefix}{r}", 0) for r in range(world)]
                except Exception:  # the store is gone: torchrun's agent ended, and with it this job
                    return
                now = time.monotonic()
                for r, count in enumerate(counts):
                    if count != seen[r]:
                        seen[r], moved_at[r] = count, now
                silent = {r: now - moved_at[r] for r in range(world) if r != rank and seen[r] > 0}
                silent = {r: s for r, s in silent.items() if s > PEER_SILENT_S}
                if silent:  # a rank that finished its run stops beating too
                    silent = {r: s for r, s in silent.items() if not store.check([f"{prefix}done/{r}"])}
                self._silent = silent  # one rebinding: a reader sees the previous beat's view or this one
                stopped = sorted(r for r, s in silent.items() if heartbeat_timeout_s > 0 and s > heartbeat_timeout_s)
                if stopped:
                    _end_silent_peers(store, prefix, rank, stopped, silent, heartbeat_timeout_s)
                stopping.wait(BEAT_INTERVAL_S)

        self._store, self._prefix, self._rank = store, prefix, rank
        self._thread = threading.Thread(target=beat, name="sft-train-store-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Tell the other ranks that this one is leaving on purpose (its heartbeat stops; it is not frozen)."""
        if self._thread is None:
            return
        self._stopping.set()
        self._thread.join(timeout=2 * BEAT_INTERVAL_S)
        with contextlib.suppress(Exception):  # the store is gone: nobody is watching
            self._store.set(f"{self._prefix}done/{self._rank}", "1")

    def peers_that_stopped(self) -> str:
        """For a collective timeout's line: the ranks whose store heartbeat stopped, or "another rank"."""
        silent = self._silent
        if not silent:
            return "another rank stopped answering (frozen, stuck or dead)"
        names = ", ".join(f"rank {r}" for r in sorted(silent))
        return f"{names} stopped answering (no heartbeat for {max(silent.values()):.0f} s)"


def _end_silent_peers(store, prefix: str, rank: int, stopped: list[int], silent: dict[int, float], timeout_s: float):
    who = {r: store.get(f"{prefix}who/{r}").decode().split() for r in stopped}
    named = ", ".join(f"rank {r} (pid {who[r][0]} on {who[r][1]})" for r in stopped)
    say_once(  # the first failure of the job is said; a rank that sees it later leaves quietly
        f"sft-train: rank {rank}: {named} stopped answering: no heartbeat for {max(silent[r] for r in stopped):.0f}"
        f" s (parallel.heartbeat_timeout_s={timeout_s:g}); stopping (a process stopped by a signal, or stuck in "
        "native code)",
        store,
    )
    if request_abort(who, store):  # sft-torchrun: each host's launcher kills its own, wherever it runs
        deadline = time.monotonic() + ABORT_WAIT_S
        while not ended(stopped, store) and time.monotonic() < deadline:
            time.sleep(0.1)
    else:
        for r in stopped:
            if who[r][1] == socket.gethostname():
                with contextlib.suppress(OSError):  # already gone
                    os.kill(int(who[r][0]), signal.SIGKILL)
    sys.stdout.flush()
    os._exit(1)


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


def run_workers(target, args: tuple, world: int, heartbeat_timeout_s: float, start_method: str = "spawn") -> None:
    """Start ``world`` workers ``target(rank, *args, beats)`` by ``start_method`` ("spawn", or "forkserver" with
    the server of ``worker_start.WorkerStart``) and wait for them; raise SystemExit with one line when one fails,
    is killed, stops answering, or the launcher is interrupted (forwarded to the workers)."""
    import torch.distributed as dist

    beats = shared_beats(world)
    # the job's store, here where no worker can freeze it: the first failure of the job claims it (said once)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    # each worker takes this environment (a forked one would otherwise keep the fork server's, from before the
    # config was checked): the job's store and this launcher's pid added
    environ = {**os.environ, STORE_ENV: f"127.0.0.1:{store.port}", LAUNCHER_ENV: str(os.getpid())}
    context = mp.start_processes(
        _worker_entry, args=(target, environ, *args, beats), nprocs=world, join=False, start_method=start_method
    )
    processes = context.processes
    running = {p.sentinel: rank for rank, p in enumerate(processes)}
    # a scheduler's SIGTERM (preemption, a cancelled job) stops the run as Ctrl-C does, saying so
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if in_main else None
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
    except (KeyboardInterrupt, _Terminated) as exc:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second signal must not cut the clean-up short
        if in_main:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for p in processes:  # the workers' own clean stop (they raise KeyboardInterrupt) for either signal
            if p.is_alive():
                os.kill(p.pid, signal.SIGINT)
        deadline = time.monotonic() + 10.0
        for p in processes:
            p.join(max(0.0, deadline - time.monotonic()))
        _end(processes)
        name, code = ("SIGTERM", 143) if isinstance(exc, _Terminated) else ("SIGINT", 130)
        verb = "terminated" if name == "SIGTERM" else "interrupted"
        print(f"sft-train: {verb} ({name}); every worker was stopped", file=sys.stderr)
        raise SystemExit(code) from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class _Terminated(Exception):
    """The launcher received SIGTERM."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated


def _worker_entry(rank: int, target, environ: dict[str, str], *args) -> None:
    """A local worker's start: the launcher's environment and Ctrl-C raising KeyboardInterrupt (the fork server
    ignores and blocks SIGINT, and its children inherit that), then ``target(rank, *args)``."""
    os.environ.clear()
    os.environ.update(environ)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    target(rank, *args)


def _exit_line(rank: int, code: int) -> str:
    if code < 0:  # killed, not stopped: say by what (SIGKILL is most often the out-of-memory killer)
        name = signal.Signals(-code).name
        hint = " (most often the out-of-memory killer: see dmesg)" if name == "SIGKILL" else ""
        return f"sft-train: worker {rank} was killed by {name}{hint}"
    return f"sft-train: stopped (worker {rank} exited with code {code})"
