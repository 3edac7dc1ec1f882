"""What rank 0 shows of a run while it trains: a tqdm progress bar on a terminal, plain lines anywhere else.

The bar (step / total, elapsed, ETA, and loss, lr, tokens/s, memory after it) is drawn only when the stream is a
TTY and ``logging.progress_bar`` is true; logs, pipes and CI get one line per ``logging.log_every`` steps.
"""

from __future__ import annotations

import os
import sys
from typing import TextIO

from sft_trainer.train import StepStats


def _loss(stats: StepStats) -> str:
    return "   n/a" if stats.loss is None else f"{stats.loss:.4f}"


def _note(stats: StepStats) -> str:
    if stats.skipped:
        return " | SKIPPED (non-finite)"
    return " | no loss tokens (not applied)" if stats.loss is None else ""


def plain_line(stats: StepStats, total: int) -> str:
    """The log line of one step (the format scripts and tests read)."""
    return (
        f"step {stats.step:5d}/{total} | loss {_loss(stats)} | tok/s {stats.extra['tokens_per_s']:9.0f} | "
        f"step {stats.seconds * 1000:7.1f} ms | mem {stats.extra['memory_gib']:.2f} GiB" + _note(stats)
    )


def bar_postfix(stats: StepStats) -> str:
    """The numbers shown after the bar."""
    return (
        f"loss {_loss(stats)} | lr {stats.lr:.2e} | tok/s {stats.extra['tokens_per_s']:.0f} | "
        f"mem {stats.extra['memory_gib']:.2f} GiB"
    )


def _terminal_columns(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):  # not a real terminal (a test's stream): tqdm's default width
        return 80


class Progress:
    """Reports each finished step of a run that goes from step ``start`` to ``total`` on ``stream``."""

    def __init__(self, total: int, start: int, log_every: int, progress_bar: bool, stream: TextIO | None = None):
        self.total, self.log_every = total, log_every
        self.stream = sys.stdout if stream is None else stream
        isatty = getattr(self.stream, "isatty", None)
        self.bar = None
        if progress_bar and isatty is not None and isatty():
            from tqdm import tqdm

            sized = _terminal_columns(self.stream) > 0  # a pty nobody sized has 0 columns: tqdm would draw nothing
            self.bar = tqdm(
                total=total,
                initial=start,
                file=self.stream,
                unit="step",
                dynamic_ncols=sized,
                ncols=None if sized else 120,
                nrows=None if sized else 24,
            )

    def update(self, stats: StepStats) -> None:
        if self.bar is not None:
            if stats.skipped:  # above the bar, so it stays on screen
                self.bar.write(f"step {stats.step}: SKIPPED (non-finite loss or gradient)", file=self.stream)
            self.bar.set_postfix_str(bar_postfix(stats), refresh=False)
            self.bar.update(stats.step - self.bar.n)
        elif stats.step % self.log_every == 0 or stats.step == self.total:
            print(plain_line(stats, self.total), file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
