"""What the Qwen3.5 and Nemotron-H CP test modules share: the row sizes, random rows, the parametrization of the
worker pools, and the check that a bad setup stops every rank alike. Module level, so that gloo workers (other
processes, importing by name) find the functions they run."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cp_core import CPTopology
from cp_core.testing import GlooWorkers, RankFailure

CP_SIZES = (2, 4)
TOTAL = {2: 48, 4: 64}  # row length per CP size: 24 and 16 tokens a rank
VOCAB = 64
IGNORE = -100
SEQ_DIMS = {"input_ids": 0, "labels": 0}

# One parametrize of the pool shared by every test: pytest keys a parametrized fixture by the index of its value in
# the parameter list, so the pool of each size is spawned once for the module.
with_workers = pytest.mark.parametrize("workers", CP_SIZES, indirect=True, ids=lambda cp: f"cp{cp}")


def make_inputs(total: int, seed: int) -> dict[str, torch.Tensor]:
    """A row of ``total`` random token ids and labels, about 15 % of them ignored."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (total,), generator=generator)
    labels = torch.randint(0, VOCAB, (total,), generator=generator)
    labels[torch.rand(total, generator=generator) < 0.15] = IGNORE
    return {"input_ids": input_ids, "labels": labels}


def plain_name(name: str) -> str:
    """A report name without activation-checkpoint wrappers."""
    return name.replace("._checkpoint_wrapped_module", "")


def all_reduce_ranks(topology: CPTopology) -> int:
    value = torch.tensor([float(topology.rank)])
    dist.all_reduce(value, group=topology.group)
    return int(value.item())


def assert_every_rank_raises(workers: GlooWorkers, fn, *args, must_name: list[str]) -> None:
    """``fn`` raises the same ContextParallelError, naming each of ``must_name``, on every rank, and the group is
    still in step afterwards (nobody was left inside a collective)."""
    results = workers.run_collect(fn, *args, timeout_s=60)
    assert len(results) == workers.world_size
    for rank, result in enumerate(results):
        assert isinstance(result, RankFailure), f"rank {rank} did not raise: {result!r}"
        assert result.rank == rank
        assert result.type_name == "ContextParallelError", f"rank {rank}: {result.type_name}: {result.message}"
        for text in must_name:
            assert text in result.message, f"rank {rank}: {text!r} not in {result.message!r}"
    assert len({r.message for r in results}) == 1, [r.message for r in results]
    cp = workers.world_size
    assert workers.run(all_reduce_ranks, timeout_s=60) == [sum(range(cp))] * cp
