"""Bad input raises the same clear ContextParallelError on every rank, no rank is left in a collective, and
the harness itself turns a hang into a bounded TimeoutError."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from cp_core import (
    ContextParallelError,
    CPTopology,
    build_packed_metadata,
    check_same_row_on_every_rank,
    gather_sequence,
    shard_position_ids,
    shard_sequence,
    ulysses_attention,
)
from cp_core.testing import GlooWorkers, RankFailure

HEAD_DIM = 4
HANG_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def workers2():
    # A short collective timeout: a rank stuck in a collective gives up soon after the harness does.
    with GlooWorkers(2, collective_timeout_s=10) as pool:
        yield pool


@pytest.fixture(scope="module")
def workers4():
    with GlooWorkers(4, collective_timeout_s=10) as pool:
        yield pool


# --------------------------------------------------------------------------------------------------------
# Worker-side functions (module level: the workers import them by name)


def _cp_step(
    topology: CPTopology,
    total: int,
    seq_lens: list[int],
    q_heads: int,
    kv_heads: int,
    batch: int = 1,
    metadata_cp: int | None = None,
) -> torch.Tensor:
    """One CP attention step the way a model runs it: metadata, positions, shards, Ulysses, gather."""
    metadata = build_packed_metadata(seq_lens, topology.rank, metadata_cp or topology.size, total_len=total)
    shard_position_ids(torch.arange(total).repeat(batch, 1), topology)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (
        shard_sequence(torch.randn(total, heads, HEAD_DIM, generator=generator), topology, 0)
        for heads in (q_heads, kv_heads, kv_heads)
    )
    out = ulysses_attention(q, k, v, metadata, topology, backend="torch")
    return gather_sequence(out, topology, 0)


def _all_reduce_ranks(topology: CPTopology) -> int:
    """Health check: every rank joins one all-reduce."""
    value = torch.tensor([float(topology.rank)])
    dist.all_reduce(value, group=topology.group)
    return int(value.item())


def _only_rank0_all_reduces(topology: CPTopology) -> int:
    if topology.rank == 0:
        dist.all_reduce(torch.ones(1), group=topology.group)  # the other ranks never join
    return topology.rank


def _last_rank_all_reduces_after_slow_rank0(topology: CPTopology, delay_s: float) -> int:
    if topology.rank == 0:
        time.sleep(delay_s)  # answers late, but inside the deadline
    if topology.rank == topology.size - 1:
        dist.all_reduce(torch.ones(1), group=topology.group)  # alone: never completes
    return topology.rank


def _check_rows(topology: CPTopology, differing_ranks: tuple[int, ...], how: str = "lengths") -> None:
    odd = topology.rank in differing_ranks
    if how == "lengths":
        check_same_row_on_every_rank([8, 8] if odd else [16], topology)
    elif how == "invalid":  # not even a valid row: compared raw, before anything could raise on that rank alone
        check_same_row_on_every_rank(["eight"] if odd else [16], topology)
    elif how == "extra":  # the same lengths, another shard size
        check_same_row_on_every_rank([16], topology, extra=(5 if odd else 4,))
    else:  # the same row, but this rank's own input checks failed (the odd ones also hold another row)
        problem = ValueError(f"labels of rank {topology.rank} are one short") if odd else None
        check_same_row_on_every_rank([8, 8] if odd else [16], topology, problem=problem)


# --------------------------------------------------------------------------------------------------------
# Every rank raises the same error


def assert_every_rank_raises(
    workers: GlooWorkers, *args, must_name: list[str], same_message: bool = True, **kwargs
) -> None:
    workers.run(_all_reduce_ranks, timeout_s=120)  # a cold pool starts here, outside the timed part
    started = time.monotonic()
    results = workers.run_collect(_cp_step, *args, timeout_s=60, **kwargs)
    assert len(results) == workers.world_size
    for rank, result in enumerate(results):
        assert isinstance(result, RankFailure), f"rank {rank} did not raise: {result!r}"
        assert result.rank == rank
        assert result.type_name == "ContextParallelError", f"rank {rank}: {result.type_name}: {result.message}"
        assert isinstance(result.exception, ContextParallelError)
        for text in must_name:
            assert text in result.message, f"rank {rank}: {text!r} not in {result.message!r}"
    if same_message:  # the same check on the same shared values
        assert len({r.message for r in results}) == 1, f"ranks disagree: {[r.message for r in results]}"
    # The ranks raised before any collective: far inside the timeout, and the group is still in step.
    assert time.monotonic() - started < 30
    assert workers.run(_all_reduce_ranks, timeout_s=60) == [sum(range(workers.world_size))] * workers.world_size


def test_valid_step_runs_on_every_rank(workers2):
    # The control: the same step with valid input succeeds, so the failures below come from the bad values.
    results = workers2.run(_cp_step, 16, [5, 7, 4], 4, 2, timeout_s=60)
    assert len(results) == 2
    assert all(r.shape == (16, 4, HEAD_DIM) for r in results)
    assert torch.equal(results[0], results[1])


def test_row_not_divisible_by_cp(workers2):
    assert_every_rank_raises(
        workers2, 17, [9, 8], 4, 2, must_name=["row length 17", "cp=2", "pad the row by 1 token(s) (to 18)"]
    )


def test_cp_does_not_divide_query_heads(workers2):
    assert_every_rank_raises(workers2, 16, [5, 11], 3, 1, must_name=["cp=2", "q_heads=3", "choose cp in [1, 3]"])


def test_kv_heads_incompatible_with_cp(workers2):
    assert_every_rank_raises(workers2, 16, [16], 6, 3, must_name=["cp=2", "kv_heads=3"])


def test_kv_heads_incompatible_with_cp4(workers4):
    assert_every_rank_raises(workers4, 32, [10, 22], 12, 6, must_name=["cp=4", "kv_heads=6"])


def test_position_ids_batch_not_one(workers2):
    assert_every_rank_raises(
        workers2, 16, [16], 4, 2, batch=3, must_name=["position_ids has batch size 3", "shape (3, 16)"]
    )


def test_seq_lens_do_not_sum_to_the_row(workers2):
    assert_every_rank_raises(workers2, 16, [5, 9], 4, 2, must_name=["seq_lens sum to 14 but the row has 16 tokens"])


def test_metadata_built_for_another_cp(workers2):
    assert_every_rank_raises(
        workers2,
        16,
        [3, 13],
        4,
        2,
        metadata_cp=4,
        same_message=False,
        must_name=["built for rank", "of cp=4", "topology is rank"],
    )
    results = workers2.run_collect(_cp_step, 16, [3, 13], 4, 2, metadata_cp=4, timeout_s=60)
    assert [f.message.split(",")[0] for f in results] == [
        "metadata was built for rank 0 of cp=4",
        "metadata was built for rank 1 of cp=4",
    ]


# --------------------------------------------------------------------------------------------------------
# The harness bounds hangs


def test_hang_becomes_timeout_and_workers_restart(workers2):
    assert workers2.run(_all_reduce_ranks, timeout_s=120) == [1, 1]  # started and answering before timing
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[0\] of 2 did not answer within 5 s.*workers restarted"):
        workers2.run_collect(_only_rank0_all_reduces, timeout_s=HANG_TIMEOUT_S)
    elapsed = time.monotonic() - started
    assert HANG_TIMEOUT_S - 0.5 <= elapsed < HANG_TIMEOUT_S + 7, f"TimeoutError after {elapsed:.1f} s"
    # The pool restarts on the next call and works again.
    assert workers2.run(_all_reduce_ranks, timeout_s=120) == [1, 1]
    assert workers2.run(_cp_step, 16, [5, 7, 4], 4, 2, timeout_s=60)[0].shape == (16, 4, HEAD_DIM)


def test_timeout_bounds_the_whole_call(workers4):
    """The deadline covers the whole call: a rank answering late does not extend the wait for a hung one."""
    delay = 4.0
    assert workers4.run(_all_reduce_ranks, timeout_s=120) == [6] * 4  # started and answering before timing
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[3\] of 4"):
        workers4.run_collect(_last_rank_all_reduces_after_slow_rank0, delay, timeout_s=HANG_TIMEOUT_S)
    elapsed = time.monotonic() - started
    # A per-rank wait would take delay + timeout = 9 s; the call must end about timeout_s after it started.
    assert HANG_TIMEOUT_S - 0.5 <= elapsed < HANG_TIMEOUT_S + 2.5, f"TimeoutError after {elapsed:.1f} s"


def test_ranks_given_different_rows_all_raise(workers4):
    """A rank given another row (seq_lens) than the others: every rank raises the same error naming the odd ranks,
    and the group stays in step; the same row passes."""
    workers4.run(_all_reduce_ranks, timeout_s=120)
    assert workers4.run(_check_rows, (), timeout_s=60) == [None] * 4
    for differing, how in (
        ((2,), "lengths"),
        ((0,), "lengths"),
        ((1, 3), "lengths"),
        ((3,), "invalid"),
        ((1,), "extra"),
    ):
        results = workers4.run_collect(_check_rows, differing, how, timeout_s=60)
        assert all(isinstance(r, RankFailure) and r.type_name == "ContextParallelError" for r in results), results
        odd = sorted({1, 2, 3} - set(differing)) if 0 in differing else list(differing)
        assert {r.message for r in results} == {results[0].message}
        assert f"rank(s) {odd} got other document lengths or input shapes than rank 0" in results[0].message
        assert workers4.run(_all_reduce_ranks, timeout_s=60) == [6] * 4


def test_a_rank_whose_own_inputs_fail_stops_every_rank(workers4):
    """A rank whose own input checks failed raises its error; every other rank raises one naming it, at once,
    instead of waiting for it in the next collective. A local problem outranks a differing row."""
    workers4.run(_all_reduce_ranks, timeout_s=120)
    for failing in ((2,), (0, 3)):
        started = time.monotonic()
        results = workers4.run_collect(_check_rows, failing, "problem", timeout_s=60)
        assert time.monotonic() - started < 30
        for rank, result in enumerate(results):
            assert isinstance(result, RankFailure), result
            if rank in failing:
                assert (result.type_name, result.message) == ("ValueError", f"labels of rank {rank} are one short")
            else:
                assert result.type_name == "ContextParallelError"
                assert f"CP rank(s) {list(failing)} rejected their inputs for this row" in result.message
                assert f"rank {rank} stops here too" in result.message
        assert workers4.run(_all_reduce_ranks, timeout_s=60) == [6] * 4


def test_without_cp_a_local_problem_is_raised_as_is():
    topology = CPTopology.single()
    with pytest.raises(KeyError, match="hidden"):
        check_same_row_on_every_rank([4], topology, problem=KeyError("hidden"))
    with pytest.raises(ContextParallelError, match="labels are short"):
        check_same_row_on_every_rank([4], topology, problem="labels are short")
    check_same_row_on_every_rank([4], topology)
