"""Sharding and gathering: single-process checks, then real gloo groups of 2 and 4 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cp_core import (
    ContextParallelError,
    CPTopology,
    gather_sequence,
    gather_variable,
    shard_mrope_positions,
    shard_position_ids,
    shard_sequence,
)
from cp_core.testing import GlooWorkers, one_torch_thread


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # The gloo workers share the 2 cores with this process; OpenMP spinning in here would starve them.
    with one_torch_thread():
        yield


# --------------------------------------------------------------------------------------------------------
# Single process


def test_topology_validation():
    single = CPTopology.single()
    assert (single.group, single.rank, single.size, single.enabled) == (None, 0, 1, False)
    assert CPTopology(group=None, rank=0, size=1) == single
    assert single.shard_range(12) == (0, 12)
    with pytest.raises(ContextParallelError, match="CP size 2 > 1 needs a process group"):
        CPTopology(group=None, rank=0, size=2)
    with pytest.raises(ContextParallelError, match="CP size must be >= 1, got 0"):
        CPTopology(group=None, rank=0, size=0)
    with pytest.raises(ContextParallelError, match=r"CP rank 1 is outside \[0, 1\)"):
        CPTopology(group=None, rank=1, size=1)
    with pytest.raises(ContextParallelError, match=r"CP rank -1 is outside \[0, 1\)"):
        CPTopology(group=None, rank=-1, size=1)
    assert not dist.is_initialized()
    assert CPTopology.from_group() == single
    with pytest.raises(ContextParallelError, match="not initialized"):
        CPTopology.from_group(object())


def test_single_rank_sharding_is_identity():
    topology = CPTopology.single()
    x = torch.randn(5, 7, 3)
    for dim in (0, 1, 2, -1):
        assert shard_sequence(x, topology, dim) is x
        assert gather_sequence(x, topology, dim) is x
        assert gather_sequence(x, topology, dim, backward="sum") is x
    # No CP: odd lengths and batches > 1 are fine.
    positions = torch.arange(14).reshape(2, 7)
    assert torch.equal(shard_position_ids(positions, topology), positions)
    mrope = torch.arange(42).reshape(3, 2, 7)
    assert torch.equal(shard_mrope_positions(mrope, topology), mrope)
    # Gradients pass straight through.
    leaf = torch.randn(6, 2, requires_grad=True)
    gather_sequence(shard_sequence(leaf, topology), topology).mul(3.0).sum().backward()
    assert torch.equal(leaf.grad, torch.full((6, 2), 3.0))


def test_single_rank_shape_errors():
    topology = CPTopology.single()
    with pytest.raises(ContextParallelError, match=r"position_ids must be \[B, S\], got shape \(7,\)"):
        shard_position_ids(torch.arange(7), topology)
    with pytest.raises(ContextParallelError, match=r"position_ids must be \[B, S\], got shape \(1, 1, 7\)"):
        shard_position_ids(torch.arange(7).reshape(1, 1, 7), topology)
    with pytest.raises(ContextParallelError, match=r"MRoPE position ids must be \[3, B, S\].*got shape \(2, 1, 8\)"):
        shard_mrope_positions(torch.zeros(2, 1, 8, dtype=torch.long), topology)
    with pytest.raises(ContextParallelError, match=r"MRoPE position ids must be \[3, B, S\].*got shape \(3, 8\)"):
        shard_mrope_positions(torch.zeros(3, 8, dtype=torch.long), topology)
    with pytest.raises(ContextParallelError, match="backward must be 'slice' or 'sum', got 'mean'"):
        gather_sequence(torch.zeros(4), topology, backward="mean")


# --------------------------------------------------------------------------------------------------------
# Worker-side helpers (module level: the workers import them by name)


def _shard_everything(topology: CPTopology, x: torch.Tensor, positions: torch.Tensor, mrope: torch.Tensor) -> dict:
    shards = {dim: shard_sequence(x, topology, dim) for dim in (0, 1, 2, -1)}
    views = {dim: s.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for dim, s in shards.items()}
    return {
        "shards": shards,
        "views": views,
        "positions": shard_position_ids(positions, topology),
        "mrope": shard_mrope_positions(mrope, topology),
        "range": topology.shard_range(x.size(0)),
        "enabled": topology.enabled,
    }


def _shape_errors(topology: CPTopology) -> list[tuple[str, str]]:
    """Every bad call, with the exception type and message it raised (or 'no error')."""
    size = topology.size
    calls = [
        lambda: shard_position_ids(torch.zeros(2, 4 * size, dtype=torch.long), topology),
        lambda: shard_mrope_positions(torch.zeros(3, 2, 4 * size, dtype=torch.long), topology),
        lambda: shard_mrope_positions(torch.zeros(2, 1, 4 * size, dtype=torch.long), topology),
        lambda: shard_mrope_positions(torch.zeros(1, 4 * size, dtype=torch.long), topology),
        lambda: shard_sequence(torch.zeros(4 * size + 1, 3), topology, 0),
        lambda: shard_sequence(torch.zeros(3, 4 * size - 1), topology, 1),
        lambda: shard_position_ids(torch.zeros(1, 4 * size + 3, dtype=torch.long), topology),
        lambda: gather_sequence(torch.zeros(4), topology, backward="mean"),
    ]
    out = []
    for call in calls:
        try:
            call()
        except Exception as exc:
            out.append((type(exc).__name__, str(exc)))
        else:
            out.append(("no error", ""))
    return out


def _round_trip(topology: CPTopology, x: torch.Tensor, dims: tuple[int, ...]) -> dict[int, torch.Tensor]:
    return {dim: gather_sequence(shard_sequence(x, topology, dim), topology, dim) for dim in dims}


def upstream_grad(shape: tuple[int, ...], rank: int, seed: int) -> torch.Tensor:
    """A different upstream gradient on every rank."""
    generator = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(shape, generator=generator)


def _gather_grad(topology: CPTopology, x: torch.Tensor, dim: int, mode: str, seed: int) -> dict[str, torch.Tensor]:
    x = x.clone().requires_grad_()
    local = shard_sequence(x, topology, dim)  # a view: its gradient lands in x's slice
    gathered = gather_sequence(local, topology, dim, backward=mode)
    gathered.backward(upstream_grad(tuple(gathered.shape), topology.rank, seed))
    return {"gathered": gathered.detach(), "grad": x.grad}


def _gather_variable(topology: CPTopology, rows: list[torch.Tensor], seed: int) -> dict:
    counts = [r.size(0) for r in rows]
    local = rows[topology.rank].clone().requires_grad_()
    gathered = gather_variable(local, counts, topology)
    gathered.backward(upstream_grad(tuple(gathered.shape), topology.rank, seed))
    return {"gathered": gathered.detach(), "grad": local.grad}


def _gather_variable_errors(topology: CPTopology) -> list[str]:
    messages = []
    for counts in ([1] * (topology.size + 1), [2] * topology.size):
        try:
            gather_variable(torch.zeros(1, 3), counts, topology)
        except ContextParallelError as exc:
            messages.append(str(exc))
    return messages


# --------------------------------------------------------------------------------------------------------
# Multi-process


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def workers(request):
    with GlooWorkers(request.param) as pool:
        yield pool


def test_shard_shapes_and_values(workers):
    cp = workers.world_size
    x = torch.randn(4 * cp, 2 * cp, 3 * cp)
    positions = torch.arange(4 * cp).unsqueeze(0) * 10
    mrope = torch.arange(3 * 4 * cp).reshape(3, 1, 4 * cp)
    results = workers.run(_shard_everything, x, positions, mrope)
    for rank, result in enumerate(results):
        assert result["enabled"] is True
        assert result["range"] == (rank * 4, rank * 4 + 4)
        for dim, shard in result["shards"].items():
            local = x.size(dim) // cp
            assert shard.shape[dim] == local and shard.dim() == 3
            assert torch.equal(shard, x.narrow(dim, rank * local, local)), (rank, dim)
            assert result["views"][dim], f"rank {rank} dim {dim}: shard_sequence copied instead of viewing"
        assert result["positions"].shape == (1, 4)
        assert result["positions"].tolist() == [[10 * t for t in range(4 * rank, 4 * rank + 4)]]
        assert result["mrope"].shape == (3, 1, 4)
        assert torch.equal(result["mrope"], mrope[:, :, 4 * rank : 4 * rank + 4])
    # The shards tile the tensor: concatenating them gives it back.
    for dim in (0, 1, 2):
        assert torch.equal(torch.cat([r["shards"][dim] for r in results], dim=dim), x)


def test_shape_errors_under_cp(workers):
    cp = workers.world_size
    for rank, errors in enumerate(workers.run(_shape_errors)):
        assert all(name == "ContextParallelError" for name, _ in errors), (rank, errors)
        messages = [message for _, message in errors]
        assert f"position_ids has batch size 2 (shape (2, {4 * cp}))" in messages[0]
        assert "micro-batch size 1" in messages[0]
        assert f"MRoPE position ids has batch size 2 (shape (3, 2, {4 * cp}))" in messages[1]
        assert f"got shape (2, 1, {4 * cp})" in messages[2]
        assert f"got shape (1, {4 * cp})" in messages[3]
        assert (
            f"sequence length (dim 0 of shape ({4 * cp + 1}, 3)) {4 * cp + 1} is not divisible by cp={cp}"
            in (messages[4])
        )
        assert f"pad the row by {cp - 1} token(s)" in messages[4]
        assert f"(dim 1 of shape (3, {4 * cp - 1})) {4 * cp - 1} is not divisible by cp={cp}" in messages[5]
        assert "pad the row by 1 token(s)" in messages[5]
        assert f"{4 * cp + 3} is not divisible by cp={cp}; pad the row by {(-3) % cp}" in (messages[6])
        assert "backward must be 'slice' or 'sum'" in messages[7]


def test_gather_round_trip(workers):
    cp = workers.world_size
    x = torch.randn(2 * cp, 3 * cp, cp)
    dims = (0, 1, 2, -1, -3)
    for rank, result in enumerate(workers.run(_round_trip, x, dims)):
        for dim in dims:
            assert torch.equal(result[dim], x), (rank, dim)
    # Non-contiguous input, and an integer tensor.
    transposed = torch.randn(3 * cp, 2 * cp).t()
    integers = torch.arange(6 * cp).reshape(2, 3 * cp)
    for result in workers.run(_round_trip, transposed, (0, 1)):
        assert torch.equal(result[0], transposed) and torch.equal(result[1], transposed)
    for result in workers.run(_round_trip, integers, (1,)):
        assert result[1].dtype == torch.int64 and torch.equal(result[1], integers)


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_gather_backward_slice_and_sum(workers, dim):
    cp = workers.world_size
    x = torch.randn(2 * cp, 2 * cp, 2 * cp)
    local = x.size(dim) // cp
    upstream = [upstream_grad(tuple(x.shape), rank, seed=dim) for rank in range(cp)]
    total = torch.stack(upstream).sum(0)

    slices = workers.run(_gather_grad, x, dim, "slice", dim)
    sums = workers.run(_gather_grad, x, dim, "sum", dim)
    for rank in range(cp):
        for result in (slices[rank], sums[rank]):
            assert torch.equal(result["gathered"], x)
        # Outside this rank's slice x gets no gradient at all.
        outside = torch.ones_like(x, dtype=torch.bool)
        outside.narrow(dim, rank * local, local).fill_(False)
        for result in (slices[rank], sums[rank]):
            assert torch.count_nonzero(result["grad"][outside]) == 0
        # slice: exactly this rank's own upstream gradient, restricted to its slice.
        got = slices[rank]["grad"].narrow(dim, rank * local, local)
        assert torch.equal(got, upstream[rank].narrow(dim, rank * local, local)), f"slice, rank {rank}"
        # sum: the slice of the sum over ranks of every rank's upstream gradient.
        got = sums[rank]["grad"].narrow(dim, rank * local, local)
        want = total.narrow(dim, rank * local, local)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"sum, rank {rank}")
        # The two modes really differ here (the upstream gradients depend on the rank).
        assert not torch.allclose(got, upstream[rank].narrow(dim, rank * local, local), atol=1e-3)


@pytest.mark.parametrize("pattern", ["uneven", "some_empty", "all_empty"])
def test_gather_variable_rows_and_summed_backward(workers, pattern):
    cp = workers.world_size
    counts = {"uneven": [3, 1, 4, 2][:cp], "some_empty": [0, 5, 0, 2][:cp], "all_empty": [0] * cp}[pattern]
    rows = [torch.randn(n, 2, 3) for n in counts]
    full = torch.cat(rows)
    results = workers.run(_gather_variable, rows, 7)
    total = torch.stack([upstream_grad(tuple(full.shape), rank, 7) for rank in range(cp)]).sum(0)
    offsets = [sum(counts[:r]) for r in range(cp)]
    for rank, result in enumerate(results):
        assert torch.equal(result["gathered"], full), rank
        want = total[offsets[rank] : offsets[rank] + counts[rank]]
        if counts[rank]:
            torch.testing.assert_close(result["grad"], want, rtol=1e-6, atol=1e-6)
        else:
            assert result["grad"] is None or result["grad"].numel() == 0
    for rank, messages in enumerate(workers.run(_gather_variable_errors)):
        assert f"must give one row count per rank of cp={cp}" in messages[0], rank
        assert f"rank {rank} holds 1 rows but counts[{rank}]=2" in messages[1], rank
