"""Parity harness: run code on real multi-process gloo CP groups and compare it with an unsharded run.

This module is public so that users can prove their own CP layers the way this project proves its own:

    from cp_core.testing import GlooWorkers, check_cp_parity, layout_cases

    with GlooWorkers(world_size=2) as workers:          # spawned once, reused for many cases
        for name, seq_lens in layout_cases(64, cp=2).items():
            report = check_cp_parity(workers, my_case, seq_lens=seq_lens, inputs={"x": x}, seq_dims={"x": 0})
            report.assert_close(rtol=1e-5)

Functions sent to workers must be importable by name (defined at module top level); arguments and results
travel through ``torch.save``. Every wait is bounded: a rank that does not answer in time raises
``TimeoutError`` in the parent and the workers are restarted, so a CP bug shows as a failure, never a hang.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import multiprocessing as mp
import os
import random
import socket
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from cp_core.attention_styles import context_parallel_attention
from cp_core.kv_gather import kv_gather_attention
from cp_core.kv_ring import kv_ring_attention
from cp_core.packing import PackedRowMetadata, build_packed_metadata
from cp_core.sharding import shard_sequence
from cp_core.topology import CPTopology

# --------------------------------------------------------------------------------------------------------
# Worker pool


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


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
    """``world_size`` spawned processes forming one gloo process group, reused across many calls.

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
        ctx = mp.get_context("spawn")
        port = _free_port()
        env_threads = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
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


# --------------------------------------------------------------------------------------------------------
# Packed layouts


def random_seq_lens(total_len: int, rng: random.Random, max_docs: int | None = None) -> list[int]:
    """Random positive document lengths summing to ``total_len`` (between 1 and ``max_docs`` documents)."""
    max_docs = min(total_len, max_docs or total_len)
    num_docs = rng.randint(1, max_docs)
    cuts = sorted(rng.sample(range(1, total_len), num_docs - 1))
    bounds = [0, *cuts, total_len]
    return [b - a for a, b in itertools.pairwise(bounds)]


def _lens_from_bounds(bounds: Sequence[int], total_len: int) -> list[int]:
    points = sorted({0, total_len, *(b for b in bounds if 0 < b < total_len)})
    return [b - a for a, b in itertools.pairwise(points)]


def layout_cases(total_len: int, cp: int, seed: int = 0) -> dict[str, list[int]]:
    """Named packed layouts that stress CP boundaries, for a row of ``total_len`` tokens over ``cp`` ranks.

    - ``single_document``: one document fills the row (it spans every rank).
    - ``cuts_on_boundaries``: every shard boundary is also a document boundary.
    - ``cuts_inside_documents``: random documents, none starting exactly at a shard boundary.
    - ``spans_all_ranks``: a document from inside the first shard to inside the last (middle ranks hold only
      its middle), with short documents around it.
    - ``tiny_documents``: documents of 1 to 3 tokens everywhere.
    - ``mixed_random``: random lengths from a seeded generator.
    """
    if total_len % cp or total_len // cp < 4:
        raise ValueError(f"layout_cases needs total_len divisible by cp with >= 4 tokens a rank, got {total_len}/{cp}")
    rng = random.Random(seed)
    local = total_len // cp
    shard_cuts = [r * local for r in range(1, cp)]
    cases: dict[str, list[int]] = {"single_document": [total_len]}

    inner = list(shard_cuts)
    for r in range(cp):
        inner += [r * local + rng.randint(1, local - 1) for _ in range(rng.randint(0, 2))]
    cases["cuts_on_boundaries"] = _lens_from_bounds(inner, total_len)

    while True:
        lens = random_seq_lens(total_len, rng, max_docs=max(2, total_len // 6))
        bounds = set(_cumulative(lens))
        if not bounds & set(shard_cuts):
            break
    cases["cuts_inside_documents"] = lens

    start, end = rng.randint(1, local - 1), total_len - rng.randint(1, local - 1)
    if end <= start:  # cp == 1: the first and last shard are the same one; keep the document non-empty
        start, end = end, start + 1
    head = [start - 1, 1] if start > 1 else [1]
    cases["spans_all_ranks"] = [*head, end - start, *([1] * (total_len - end))]

    tiny: list[int] = []
    while sum(tiny) < total_len:
        tiny.append(min(rng.randint(1, 3), total_len - sum(tiny)))
    cases["tiny_documents"] = tiny
    cases["mixed_random"] = random_seq_lens(total_len, rng, max_docs=max(1, total_len // 4))
    return cases


def _cumulative(lens: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for x in lens:
        acc += x
        out.append(acc)
    return out


# --------------------------------------------------------------------------------------------------------
# Sharded vs unsharded parity


@dataclass
class ParityReport:
    """Largest differences between the CP run and the unsharded run, per compared tensor.

    ``relative`` is ``max |cp - ref| / max |ref|`` (the error relative to the tensor's scale).
    """

    absolute: dict[str, float] = field(default_factory=dict)
    relative: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, got: torch.Tensor, expected: torch.Tensor) -> None:
        if got.shape != expected.shape:
            raise AssertionError(f"{name}: CP shape {tuple(got.shape)} != reference shape {tuple(expected.shape)}")
        self.absolute[name] = (got.double() - expected.double()).abs().max().item() if got.numel() else 0.0
        self.relative[name] = relative_max(got, expected)

    @property
    def worst(self) -> tuple[str, float]:
        name = max(self.relative, key=self.relative.__getitem__)
        return name, self.relative[name]

    def assert_close(self, rtol: float = 1e-5, rtols: Mapping[str, float] | None = None) -> None:
        """Raise listing every tensor whose relative difference exceeds its tolerance."""
        rtols = rtols or {}
        bad = {
            name: (rel, rtols.get(name, rtol))
            for name, rel in self.relative.items()
            if not rel <= rtols.get(name, rtol)  # NaN fails too
        }
        if bad:
            lines = [f"{n}: relative {r:.3e} > {tol:.1e} (abs {self.absolute[n]:.3e})" for n, (r, tol) in bad.items()]
            raise AssertionError("CP differs from the unsharded run:\n" + "\n".join(lines))

    def __str__(self) -> str:
        return "\n".join(f"{n}: rel {self.relative[n]:.2e} abs {self.absolute[n]:.2e}" for n in self.relative)


ParityCase = Callable[..., torch.Tensor]


def run_parity_case(
    topology: CPTopology,
    case: ParityCase,
    seq_lens: Sequence[int],
    inputs: Mapping[str, torch.Tensor],
    seq_dims: Mapping[str, int | None],
    module_factory: Callable[[], torch.nn.Module] | None,
    out_seq_dim: int,
    seed: int,
) -> dict[str, Any]:
    """One rank's share of a parity check (also the unsharded reference when ``topology.size == 1``).

    Shards the sequence inputs, runs ``case(module, metadata, topology, **local_inputs)``, back-propagates a
    fixed random output gradient (the same full tensor on every rank, sharded), and returns the local output
    and the gradients of the local inputs and of the module's parameters.
    """
    metadata = build_packed_metadata(seq_lens, topology.rank, topology.size)
    module = None
    if module_factory is not None:
        torch.manual_seed(seed)
        module = module_factory()
    local: dict[str, torch.Tensor] = {}
    for name, tensor in inputs.items():
        dim = seq_dims.get(name)
        piece = tensor if dim is None else shard_sequence(tensor, topology, dim)
        piece = piece.detach().clone()
        local[name] = piece.requires_grad_(piece.is_floating_point())
    out = case(module, metadata, topology, **local)
    full_shape = list(out.shape)
    full_shape[out_seq_dim] *= topology.size
    generator = torch.Generator().manual_seed(seed + 1)
    grad_out = torch.randn(full_shape, generator=generator, dtype=torch.float64).to(out.dtype)
    grad_out = shard_sequence(grad_out, topology, out_seq_dim).to(out.device)
    out.backward(grad_out)
    grads = {f"grad.{n}": t.grad.detach().cpu() for n, t in local.items() if t.grad is not None}
    params = {}
    if module is not None:
        params = {f"grad.param.{n}": p.grad.detach().cpu() for n, p in module.named_parameters() if p.grad is not None}
    return {"out": out.detach().cpu(), **grads, **params}


def check_cp_parity(
    workers: GlooWorkers,
    case: ParityCase,
    *,
    seq_lens: Sequence[int],
    inputs: Mapping[str, torch.Tensor],
    seq_dims: Mapping[str, int | None],
    module_factory: Callable[[], torch.nn.Module] | None = None,
    out_seq_dim: int = 0,
    seed: int = 0,
) -> ParityReport:
    """Compare ``case`` on ``workers`` (sharded over ``workers.world_size`` ranks) with one unsharded run.

    Compared: the output (shards concatenated), the gradient of every floating-point input (sequence-sharded
    inputs concatenated, replicated ones summed over ranks) and of every module parameter (summed over ranks,
    as a data-parallel-style all-reduce would). ``case`` must be a module-level function.
    """
    reference = run_parity_case(
        CPTopology.single(), case, seq_lens, inputs, seq_dims, module_factory, out_seq_dim, seed
    )
    shards = workers.run(run_parity_case, case, seq_lens, inputs, seq_dims, module_factory, out_seq_dim, seed)
    report = ParityReport()
    for name, expected in reference.items():
        missing = [rank for rank, shard in enumerate(shards) if name not in shard]
        if missing:
            raise AssertionError(f"{name} has a gradient unsharded but not on CP rank(s) {missing}")
        pieces = [shard[name] for shard in shards]
        if name == "out":
            got = torch.cat(pieces, dim=out_seq_dim)
        elif name.startswith("grad.param."):
            got = torch.stack(pieces).sum(0)
        else:
            dim = seq_dims.get(name.removeprefix("grad."))
            got = torch.stack(pieces).sum(0) if dim is None else torch.cat(pieces, dim=dim)
        report.add(name, got, expected)
    extra = set().union(*(shard.keys() for shard in shards)) - reference.keys()
    if extra:
        raise AssertionError(f"CP ranks produced gradients the unsharded run did not: {sorted(extra)}")
    return report


def kv_attention_case(
    module: None,
    metadata: PackedRowMetadata,
    topology: CPTopology,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    ring: bool = False,
    scale: float | None = None,
    sliding_window: int | None = None,
    balance: bool = True,
    strided: bool = False,
) -> torch.Tensor:
    """A parity case (:func:`check_cp_parity`): all-gathered KV, or ring-passed KV with ``ring``, on the torch
    backend. ``strided``: q with the same values, dense but not contiguous (what a rank sends must still be)."""
    if strided:
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
        assert not q.is_contiguous()
    attend = kv_ring_attention if ring else kv_gather_attention
    return attend(
        q, k, v, metadata, topology, scale=scale, sliding_window=sliding_window, backend="torch", balance=balance
    )  # fmt: skip


def attention_style_difference(
    topology: CPTopology, seq_lens: Sequence[int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, styles
) -> float:
    """On this rank (a :class:`GlooWorkers` function): the largest difference between the outputs of two attention
    CP styles (``styles``, e.g. ``("kv_ring", "kv_gather")``) for the row's ``q``, ``k``, ``v``, torch backend."""
    meta = build_packed_metadata(seq_lens, topology.rank, topology.size)
    local = [t[meta.shard_start : meta.shard_end] for t in (q, k, v)]
    a, b = (context_parallel_attention(*local, meta, topology, style, backend="torch") for style in styles)
    return (a - b).abs().max().item()


def attention_parity_failures(
    workers: GlooWorkers,
    case: ParityCase,
    layouts: Mapping[str, Sequence[int]],
    *,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    v_dim: int | None = None,
    rtol: float = 1e-5,
) -> list[str]:
    """``case`` (attention over ``q`` [S, Hq, D], ``k`` [S, Hkv, D], ``v`` [S, Hkv, Dv]) sharded over ``workers``
    against the unsharded run, row by row of ``layouts``, on fp32 inputs seeded by the layout's index and the head
    counts; one line per layout whose output or any input gradient differs by more than ``rtol`` (or is missing)."""
    failures = []
    for index, (layout, seq_lens) in enumerate(layouts.items()):
        seed, total = 100 * index + q_heads + kv_heads, sum(seq_lens)
        shapes = {"q": (q_heads, head_dim), "k": (kv_heads, head_dim), "v": (kv_heads, v_dim or head_dim)}
        inputs = {
            name: torch.randn((total, *shape), generator=torch.Generator().manual_seed(seed + offset))
            for offset, (name, shape) in enumerate(shapes.items())
        }
        report = check_cp_parity(
            workers, case, seq_lens=seq_lens, inputs=inputs, seq_dims={"q": 0, "k": 0, "v": 0}, seed=seed
        )
        if set(report.relative) != {"out", "grad.q", "grad.k", "grad.v"}:
            failures.append(f"{layout} {list(seq_lens)}: compared only {sorted(report.relative)}")
            continue
        try:
            report.assert_close(rtol=rtol)
        except AssertionError as exc:
            failures.append(f"{layout} {list(seq_lens)}: {exc}")
    return failures


# --------------------------------------------------------------------------------------------------------
# True fp64 runs


class KeepFloat64(TorchFunctionMode):
    """``Tensor.float()`` leaves float64 tensors as they are (a model's fp32 upcasts become no-ops in fp64)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.float and args[0].dtype == torch.float64:
            return args[0]
        return func(*args, **(kwargs or {}))


def _enter_keep_float64(module: torch.nn.Module, args) -> None:
    mode = KeepFloat64()
    mode.__enter__()
    module.__dict__.setdefault("_keep_float64_modes", []).append(mode)


def _exit_keep_float64(module: torch.nn.Module, args, output) -> None:
    module.__dict__["_keep_float64_modes"].pop().__exit__(None, None, None)


def keep_float64_(model: torch.nn.Module, layers: Iterable[torch.nn.Module] = ()) -> torch.nn.Module:
    """Run ``model`` (already ``.double()``) in true fp64: models compute norms, decays and routers in fp32
    (``.float()``), which would cap an fp64 comparison at fp32 rounding. Hooks on ``model`` and on each of ``layers``
    (pass the activation-checkpointed blocks, so that their recomputation in backward is covered too) make those
    casts no-ops. An fp64 comparison separates a CP bug (any size) from fp32 rounding amplified by cancellation."""
    for module in (model, *layers):
        module.register_forward_pre_hook(_enter_keep_float64)
        module.register_forward_hook(_exit_keep_float64)
    return model


# --------------------------------------------------------------------------------------------------------
# Fast kernels vs reference paths (GPU)


def saved_storages(run: Callable[[], Any]) -> tuple[Any, dict[int, int]]:
    """``run()``'s result and the storages autograd keeps for its backward, ``{data_ptr: nbytes}``: what a saved
    tensor costs, views of one storage counted once. Every packed tensor is held until ``run`` returns, so an
    address freed and reused inside the run is not mistaken for one storage."""
    storages: dict[int, int] = {}
    held = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        held.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = run()
    return result, storages


def relative_l2(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-300) -> float:
    """``||a - b|| / ||b||`` in fp64, the denominator at least ``floor`` (for a reference that is zero in exact
    arithmetic)."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(floor)).item()


def relative_max(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|`` in fp64, the error relative to the reference's scale (the absolute difference
    where ``b`` is all zero); what :class:`ParityReport` records per tensor."""
    diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    scale = b.double().abs().max().item() if b.numel() else 0.0
    return diff / scale if scale > 0 else diff


@dataclass
class KernelAgreement:
    """How far a fast-kernel model is from the same weights on the reference paths, and both from fp32.

    ``output``: fast vs reference output; ``fast_vs_fp32`` / ``reference_vs_fp32``: each low-precision output
    against the fp32 run (the fast path should be no worse than the reference in the same dtype);
    ``grads``: fast vs reference parameter gradient, by name; ``grads_fast_vs_fp32`` /
    ``grads_reference_vs_fp32``: each low-precision gradient against the fp32 run's, by name.
    """

    output: float
    fast_vs_fp32: float
    reference_vs_fp32: float
    grads: dict[str, float]
    grads_fast_vs_fp32: dict[str, float] = field(default_factory=dict)
    grads_reference_vs_fp32: dict[str, float] = field(default_factory=dict)

    def grads_worse_than_reference(self, factor: float = 1.25, slack: float = 1e-2) -> dict[str, tuple[float, float]]:
        """Parameters whose fast gradient is further from fp32 than ``factor`` x the reference's (+ ``slack``):
        name -> (fast vs fp32, reference vs fp32). Empty when the fast path is as good as the reference dtype."""
        return {
            name: (err, self.grads_reference_vs_fp32[name])
            for name, err in self.grads_fast_vs_fp32.items()
            if err > factor * self.grads_reference_vs_fp32[name] + slack
        }

    @property
    def worst_grad(self) -> tuple[str, float]:
        name = max(self.grads, key=self.grads.__getitem__)
        return name, self.grads[name]

    def __str__(self) -> str:
        name, worst = self.worst_grad
        return (
            f"output rel {self.output:.2e}; worst grad {name} rel {worst:.2e}; vs fp32: fast "
            f"{self.fast_vs_fp32:.2e}, reference {self.reference_vs_fp32:.2e}"
        )


def kernel_agreement(
    make_model: Callable[[str], torch.nn.Module],
    forward: Callable[[torch.nn.Module], torch.Tensor],
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> KernelAgreement:
    """Compare a model on its fast kernels with the same weights on the reference (torch) paths.

    ``make_model(backend)`` builds the model for ``backend`` "fast" or "reference" (on the target device, fp32);
    all three runs (fast in ``dtype``, reference in ``dtype``, reference in fp32) share the weights of one fp32
    model. ``forward(model)`` returns the output to compare; the same random output gradient is back-propagated
    through all three.
    """
    started = time.perf_counter()

    def note(what: str) -> None:
        if log is not None:
            log(f"[kernel_agreement] {what} at {time.perf_counter() - started:.1f} s")

    torch.manual_seed(seed)
    fp32 = make_model("reference")
    reference, fast = make_model("reference"), make_model("fast")
    note("models built")
    for model in (reference, fast):
        model.load_state_dict(fp32.state_dict())
        model.to(dtype)
    outputs = {}
    upstream = None
    for name, model in (("fast", fast), ("reference", reference), ("fp32", fp32)):
        out = forward(model).float()
        if upstream is None:
            generator = torch.Generator(device=out.device).manual_seed(seed + 1)
            upstream = torch.randn(out.shape, device=out.device, generator=generator)
        (out * upstream).sum().backward()
        outputs[name] = out.detach()
        note(f"{name} forward + backward done")
    ref_params, fp32_params = dict(reference.named_parameters()), dict(fp32.named_parameters())
    with_grad = [(n, p) for n, p in fast.named_parameters() if p.grad is not None]
    return KernelAgreement(
        output=relative_l2(outputs["fast"], outputs["reference"]),
        fast_vs_fp32=relative_l2(outputs["fast"], outputs["fp32"]),
        reference_vs_fp32=relative_l2(outputs["reference"], outputs["fp32"]),
        grads={n: relative_l2(p.grad, ref_params[n].grad) for n, p in with_grad},
        grads_fast_vs_fp32={n: relative_l2(p.grad, fp32_params[n].grad) for n, p in with_grad},
        grads_reference_vs_fp32={n: relative_l2(ref_params[n].grad, fp32_params[n].grad) for n, p in with_grad},
    )


# --------------------------------------------------------------------------------------------------------
# Communication accounting


@dataclass
class CollectiveRecord:
    op: str
    payload_bytes: int
    """Bytes of the tensor handed to the collective on this rank."""
    sent_bytes: int
    """Bytes this rank sends to other ranks (the part of the payload that leaves the rank)."""


class CommCounter(TorchDispatchMode):
    """Records every c10d collective issued inside the ``with`` block, with the bytes this rank sends.

    Counted from the tensors actually handed to the collectives. Bytes sent, for a group of ``n`` ranks:
    all-to-all ``payload (n-1)/n``; all-gather ``payload (n-1)`` (each peer needs the shard); reduce-scatter
    ``payload (n-1)/n``; all-reduce ``2 payload (n-1)/n`` (ring); send ``payload``; receive 0; anything else
    (e.g. broadcast) ``payload``.

    It is a ``TorchDispatchMode``: every aten op inside the block passes through Python. Count bytes and time on
    different steps (a 256k-token Qwen3.5-0.8B step on an H200 ran 2.9x slower inside the block).
    """

    def __init__(self, group_size: int):
        super().__init__()
        self.group_size = group_size
        self.records: list[CollectiveRecord] = []

    @property
    def total_sent_bytes(self) -> int:
        return sum(r.sent_bytes for r in self.records)

    def _sent(self, op: str, payload: int) -> int:
        n = self.group_size
        if "recv" in op:
            return 0
        if "alltoall" in op or "reduce_scatter" in op:
            return payload * (n - 1) // n
        if "allgather" in op:
            return payload * (n - 1)
        if "allreduce" in op:
            return 2 * payload * (n - 1) // n
        return payload

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name.startswith("c10d.") and not name.startswith(("c10d.barrier", "c10d.monitored_barrier")):
            payload = _input_bytes(name, args)
            self.records.append(CollectiveRecord(name, payload, self._sent(name, payload)))
        return func(*args, **kwargs)


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item)]
    return []


def _input_bytes(op: str, args: tuple) -> int:
    # c10d ops take (outputs, inputs, ...) for gathers/scatters and all-to-all, (tensors, ...) otherwise.
    if any(key in op for key in ("alltoall", "allgather", "reduce_scatter", "_allgather_base", "_reduce_scatter")):
        tensors = _tensors(args[1])
    else:
        tensors = _tensors(args[0])
    return sum(t.numel() * t.element_size() for t in tensors)


# --------------------------------------------------------------------------------------------------------
# One rank's share without the other ranks


def declared_version(pyproject: str | os.PathLike) -> str:
    """The ``[project] version`` a package's pyproject.toml declares (what its ``__version__`` must say)."""
    import tomllib

    with open(pyproject, "rb") as f:
        return tomllib.load(f)["project"]["version"]


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


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int):
    """Make this process ``rank`` of a ``world_size``-rank ``fake`` process group for the ``with`` block.

    torch's fake backend completes every collective at once with correctly shaped, meaningless outputs, so one
    process can run one rank's share of a CP step at true shapes (memory, compute time, and with
    :class:`CommCounter` the bytes it would send) without peers. Yields the group (``dist.group.WORLD``) and
    destroys it on exit, also when the block raises. ``world_size=1`` creates nothing and yields None (the
    unsharded run: ``set_context_parallel_attributes(model, None, 0, 1)``). Refuses to replace a process group that
    already exists.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not 0 <= rank < world_size:
        raise ValueError(f"fake_process_group: rank={rank} must be in [0, world_size={world_size})")
    if world_size == 1:
        yield None
        return
    if dist.is_initialized():
        raise RuntimeError("fake_process_group: a default process group already exists; destroy it first")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
