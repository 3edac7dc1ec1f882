"""A pool of processes forming one gloo process group, reused across many calls.

Workers are forked from multiprocessing's fork server, which imports torch and the packages under test once, instead
of spawned as fresh interpreters that each import torch again (4 workers: ~30 s spawned, ~0.5 s forked on a loaded
2-core machine). Workers get the environment the fork server started with (at the first pool's start), not later
changes to ``os.environ``. Functions sent to workers must be importable by name (defined at module top level);
arguments and results travel through ``torch.save``. Every wait is bounded: a rank that does not answer in time raises
``TimeoutError`` in the parent and the workers are restarted, so a CP bug shows as a failure, never a hang.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from cp_core.topology import CPTopology


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


@dataclass
@dataclass
class RankFailure:
    """An exception raised on one rank, carried back to the parent."""

    rank: int
    type_name: str
    message: str
    traceback: str
    exception: BaseException | None = None


class RankError(RuntimeError):
    """One or more ranks raised; ``failures`` holds each rank's exception."""

    def __init__(self, failures: list[RankFailure]):
        self.failures = failures
        details = "\n".join(f"--- rank {f.rank}: {f.type_name}: {f.message}\n{f.traceback}" for f in failures)
        super().__init__(f"{len(failures)} rank(s) raised:\n{details}")


# The fork server imports these once (its first pool's start pays for it); every worker forked from it has them.
# backward(gradient) imports the last two (and sympy) on its first call: 3 s of CPU in each worker otherwise.
_PRELOAD = (
    "torch",
    "torch.distributed",
    "cp_core.testing.workers",
    "torch.fx.experimental.symbolic_shapes",
    "torch.nested._internal.nested_tensor",
)
# Imported there too when the test process has them (test modules import pytest, the model packages transformers;
# building the VL model's vision tower imports transformers.modeling_utils: 15 s per worker on a loaded machine).
_PRELOAD_IF_LOADED = ("pytest", "transformers", "transformers.modeling_utils", "cp_models", "cp_vlm", "sft_trainer")


def _context() -> Any:
    """The fork-server context; the preload list only takes effect when the server starts (the first pool)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*_PRELOAD, *(name for name in _PRELOAD_IF_LOADED if name in sys.modules)])
    return ctx


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(rank: int, world_size: int, port: int, conn, collective_timeout_s: float) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=collective_timeout_s),
    )
    topology = CPTopology.from_group(dist.group.WORLD)
    try:
        while True:
            message = conn.recv_bytes()
            if not message:
                break
            try:
                fn, args, kwargs = _loads(message)
                reply = ("ok", fn(topology, *args, **kwargs))
            except BaseException as exc:  # report every failure to the parent, keep serving
                tb = traceback.format_exc()
                try:
                    _dumps(exc)
                    carried = exc
                except Exception:
                    carried = None
                reply = ("error", RankFailure(rank, type(exc).__name__, str(exc), tb, carried))
            conn.send_bytes(_dumps(reply))
    finally:
        dist.destroy_process_group()


class GlooWorkers:
    """``world_size`` processes forming one gloo process group, reused across many calls.

    ``run(fn, *args)`` calls ``fn(topology, *args)`` on every rank and returns the per-rank results.
    """

    def __init__(self, world_size: int, timeout_s: float = 180.0, collective_timeout_s: float = 60.0):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.collective_timeout_s = collective_timeout_s
        self._procs: list[mp.Process] = []
        self._conns: list[Any] = []

    def __enter__(self) -> GlooWorkers:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self) -> None:
        if self._procs:
            return
        ctx = _context()
        port = _free_port()
        env_threads = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # read by the fork server when the first pool starts it
        try:
            for rank in range(self.world_size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=_worker_main,
                    args=(rank, self.world_size, port, child, self.collective_timeout_s),
                    daemon=True,
                )
                proc.start()
                child.close()
                self._procs.append(proc)
                self._conns.append(parent)
        finally:
            if env_threads is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = env_threads

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send_bytes(b"")
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    def run_collect(self, fn: Callable, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """Like :meth:`run`, but returns a :class:`RankFailure` in place of each rank that raised."""
        self.start()
        payload = _dumps((fn, args, kwargs))
        for conn in self._conns:
            conn.send_bytes(payload)
        # One deadline for the whole call (not per rank), so a hang is bounded by timeout_s however the
        # ranks' answers are spread out in time.
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.timeout_s)
        results: list[Any] = []
        silent: list[int] = []
        for rank, conn in enumerate(self._conns):
            try:
                if conn.poll(max(0.0, deadline - time.monotonic())):
                    _status, value = _loads(conn.recv_bytes())
                    results.append(value)
                    continue
            except (EOFError, OSError):  # the worker died (crash, kill): the group is unusable as well
                pass
            silent.append(rank)
            deadline = max(deadline, time.monotonic() + 1.0)  # a last short grace for the ranks not yet read
        if silent:
            self._kill()  # the group may be wedged in a collective; the next call starts afresh
            raise TimeoutError(
                f"rank(s) {silent} of {self.world_size} did not answer within {timeout_s or self.timeout_s:.0f} s "
                f"running {getattr(fn, '__qualname__', fn)}; workers restarted"
            )
        return results

    def run(self, fn: Callable, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """``fn(topology, *args, **kwargs)`` on every rank; raises :class:`RankError` if any rank raised."""
        results = self.run_collect(fn, *args, timeout_s=timeout_s, **kwargs)
        failures = [r for r in results if isinstance(r, RankFailure)]
        if failures:
            raise RankError(failures)
        return results

    def assert_failing_ranks_stop_every_rank(
        self, fn: Callable, *args: Any, failing: Sequence[int], says: str, within_s: float = 30.0, **kwargs: Any
    ) -> None:
        """Run ``fn`` where ranks ``failing`` reject their own inputs: each of them must raise an error whose message
        holds ``says``, every other rank a ContextParallelError naming them, all within ``within_s`` (nobody waits
        for them in a collective), and the group must still be in step afterwards."""
        started = time.monotonic()
        results = self.run_collect(fn, *args, timeout_s=max(60.0, 2 * within_s), **kwargs)
        assert time.monotonic() - started < within_s, f"the ranks took {time.monotonic() - started:.1f} s to stop"
        for rank, result in enumerate(results):
            assert isinstance(result, RankFailure), f"rank {rank} did not raise: {result!r}"
            if rank in failing:
                assert says in result.message, f"rank {rank}: {says!r} not in {result.message!r}"
            else:
                naming = f"CP rank(s) {sorted(failing)} rejected their inputs"
                assert result.type_name == "ContextParallelError", f"rank {rank}: {result.type_name}: {result.message}"
                assert naming in result.message, f"rank {rank}: {naming!r} not in {result.message!r}"
        assert self.run(_rank_sum, timeout_s=60) == [sum(range(self.world_size))] * self.world_size


def _rank_sum(topology: CPTopology) -> int:
    """Every rank joins one all-reduce of its rank (a health check of the group)."""
    value = torch.tensor([float(topology.rank)])
    dist.all_reduce(value, group=topology.group)
    return int(value.item())


@contextlib.contextmanager
def one_torch_thread():
    """torch on one intra-op thread inside the block (restored after). For test modules whose gloo workers share
    the machine's few cores, or whose tensors are so small that OpenMP's fork-join costs more than the work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
