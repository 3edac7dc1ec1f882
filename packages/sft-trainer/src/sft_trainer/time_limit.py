"""A time limit on a block of Python code, for work that may run without end (a user's chat template)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def time_limit(seconds: float | None, error: Callable[[], BaseException]) -> Iterator[None]:
    """Raise ``error()`` in the block once it runs past ``seconds``. A timer signal interrupts the block between
    Python bytecodes, so the limit holds in a process's main thread on POSIX; elsewhere, or with no ``seconds``,
    the block runs unlimited. The process's own SIGALRM handler is restored after the block."""
    if not seconds or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(_signum, _frame):
        raise error()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
