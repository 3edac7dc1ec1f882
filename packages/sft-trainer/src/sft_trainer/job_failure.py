"""A job's first failure, said once: the one ``sft-train: ...`` line a failing rank would print, claimed in the
job's store so that the ranks failing after it (or alongside it) stay quiet.

The store is the one every rank of the job reaches without depending on a worker: torchrun's agent store
(``MASTER_ADDR``/``MASTER_PORT`` when ``TORCHELASTIC_USE_AGENT_STORE`` is set), or the store the local
launcher hosts for its spawned workers (``SFT_TRAIN_STORE``). The first rank to count itself in ``claims`` writes
its line to ``failure`` and prints it; the others print nothing, even where their line is the same. Under
``sft-torchrun`` (``SFT_TRAIN_LAUNCHER_DIR`` set) the claiming rank writes its line to that folder instead of
printing it: the launcher prints it once, naming the ranks that failed, and reads
the ``abort`` record (the ranks another rank saw stop answering) to kill its own frozen workers.
Without a store (none reachable), every failing rank prints as before: said more than once rather than never.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import sys
import time
import traceback
from pathlib import Path

LAUNCHER_DIR_ENV = "SFT_TRAIN_LAUNCHER_DIR"  # set by sft-torchrun: the folder its local workers report into
STORE_ENV = "SFT_TRAIN_STORE"  # "host:port" of the store the local launcher hosts for its spawned workers
STORE_TIMEOUT_S = 10.0
SAID_WAIT_S = 5.0  # how long a rank that lost the claim waits for the winner's line
READ_GRACE_S = 1.0  # after the claim, long enough for every launcher's watcher (4 reads a second) to see it


def restart_count() -> str:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def key_prefix(restart: str | None = None) -> str:
    """Keys of this torchrun attempt (a restart starts afresh)."""
    return f"sft-train/job/{restart_count() if restart is None else restart}/"


def job_store():
    """This job's store, or None where no store outlives the workers (then each rank speaks for itself)."""
    if os.environ.get(STORE_ENV):
        host, _, port = os.environ[STORE_ENV].rpartition(":")
        return _store_at(host, int(port))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_PORT" in os.environ:
        return _store_at(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    return None


@functools.cache  # one client per store and process: a failing rank reaches it several times
def _store_at(host: str, port: int):
    try:
        import torch.distributed as dist

        return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
    except Exception:  # the store is gone (the agent ended): nobody else is left to speak
        return None


def claim(line: str, store=None) -> bool:
    """Whether ``line`` is the job's first failure (this rank then says it); True without a store."""
    store = store if store is not None else job_store()
    if store is None:
        return True
    try:
        # a counter, not compare_set on the line itself: ranks failing with the same text would each read their own
        # line back and all win
        if store.add(f"{key_prefix()}claims", 1) != 1:
            return False
        store.set(f"{key_prefix()}failure", line)  # the line the launchers read and say
        return True
    except Exception:
        return True


def _mark_said(store=None) -> None:
    """Tell the ranks that lost the claim that the line is out: they may leave now."""
    store = store if store is not None else job_store()
    if store is not None:
        with contextlib.suppress(Exception):
            store.set(f"{key_prefix()}said", "1")


def wait_until_said(store=None) -> None:
    """A rank that lost the claim (or leaves the speaking to another) stays until the job's first failure has been
    said (at most ``SAID_WAIT_S``): leaving at once would end the job, and torchrun would stop the speaker before it
    speaks."""
    store = store if store is not None else job_store()
    if store is None:
        return
    deadline = time.monotonic() + SAID_WAIT_S
    while time.monotonic() < deadline:
        try:
            if store.check([f"{key_prefix()}said"]):
                return
        except Exception:  # the store is gone: nobody is left to wait for
            return
        time.sleep(0.05)


def say_once(line: str, store=None) -> bool:
    """Print ``line`` (under sft-torchrun: hand it to the launcher) when it is the job's first failure; otherwise
    wait until the rank that claimed it has said its own."""
    if not claim(line, store):
        wait_until_said(store)
        return False
    if not _hand_to_launcher(line):
        print(line, file=sys.stderr, flush=True)
    _mark_said(store)
    return True


def report_exception(exc: BaseException) -> None:
    """An unexpected error (a bug, not a user's mistake): its traceback, said by the first failing rank only (a
    peer's error is most often this one's consequence: a broken connection)."""
    first_line = (str(exc).strip().splitlines() or [""])[0][:300]
    line = f"sft-train: rank {os.environ.get('RANK', '?')} failed: {type(exc).__name__}: {first_line}"
    if not claim(line):
        wait_until_said()
        return
    traceback.print_exception(exc)
    sys.stderr.flush()
    _hand_to_launcher(line)  # under sft-torchrun the launcher says the line after the traceback
    _mark_said()


def announce_store() -> None:
    """Under sft-torchrun: tell this host's launcher where the job's store is (it watches the abort record) and
    this worker's pid (it ends the workers still running once the job has failed)."""
    folder = os.environ.get(LAUNCHER_DIR_ENV)
    if folder and "MASTER_PORT" in os.environ:
        _write(Path(folder) / "store", f"{os.environ['MASTER_ADDR']} {os.environ['MASTER_PORT']} {restart_count()}")
        _write(Path(folder) / f"worker-{os.environ.get('RANK', '0')}", str(os.getpid()))


def request_abort(who: dict[int, list[str]], store=None) -> bool:
    """Under sft-torchrun: ask every host's launcher to kill the frozen ranks it runs; ``who`` maps each to its
    (pid, host, parent pid) and each launcher marks ``ended/<rank>`` for its own. Returns False where no launcher
    of ours watches (plain torchrun)."""
    store = store if store is not None else job_store()
    if store is None or not os.environ.get(LAUNCHER_DIR_ENV):
        return False
    record = ";".join(" ".join([str(rank), *who[rank][:3]]) for rank in sorted(who))
    with contextlib.suppress(Exception):
        store.set(f"{key_prefix()}abort", record)
        return True
    return False


def ended(ranks: list[int], store=None) -> bool:
    """Whether the launchers marked every one of ``ranks`` killed."""
    store = store if store is not None else job_store()
    try:
        return store.check([f"{key_prefix()}ended/{r}" for r in ranks])
    except Exception:  # the store is gone: nobody is left to wait for
        return True


def _hand_to_launcher(line: str) -> bool:
    """Under sft-torchrun: leave ``line`` for this host's launcher to say. Whether it was left."""
    folder = os.environ.get(LAUNCHER_DIR_ENV)
    if not folder or not _write(Path(folder) / "failure", line):
        return False
    time.sleep(READ_GRACE_S)  # the other hosts' launchers read it from the store, which ends with this job
    return True


def _write(path: Path, text: str) -> bool:
    """Write ``text`` to ``path`` whole (a reader never sees half of it)."""
    try:
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_text(text)
        partial.replace(path)
        return True
    except OSError:
        return False


def one_line(exc: BaseException, limit: int = 600) -> str:
    """``Type: message`` of ``exc`` on one line, cut at ``limit`` characters."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
