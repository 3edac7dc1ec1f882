"""cp_core.testing.fake_process_group: one rank's share at true shapes, the bytes CommCounter sees, and no group
left behind (also after an error)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cp_core import CPTopology, heads_to_sequence, sequence_to_heads
from cp_core.testing import CommCounter, fake_process_group


def test_collectives_have_true_shapes_and_counted_bytes():
    with fake_process_group(1, 4) as group:
        topology = CPTopology.from_group(group)
        assert (topology.rank, topology.size) == (1, 4)
        x = torch.zeros(8, 4, 16, requires_grad=True)  # 8 local tokens, 4 heads
        with CommCounter(4) as counter:
            heads = sequence_to_heads(x, topology)
            assert heads.shape == (32, 1, 16)  # the whole row, one head
            heads_to_sequence(heads, topology).sum().backward()
        assert x.grad.shape == x.shape
        payload = x.numel() * x.element_size()
        # forward: to heads and back; backward: the same two in reverse; each sends 3/4 of its payload
        assert counter.total_sent_bytes == 4 * payload * 3 // 4
    assert not dist.is_initialized()


def test_the_group_is_destroyed_when_the_block_raises():
    with pytest.raises(ZeroDivisionError), fake_process_group(0, 2):
        assert dist.is_initialized()
        _ = 1 / 0
    assert not dist.is_initialized()


def test_refuses_a_second_group_and_a_bad_rank():
    with fake_process_group(0, 2):
        with pytest.raises(RuntimeError, match="already exists"), fake_process_group(0, 2):
            pass
        assert dist.is_initialized()  # the outer group is untouched
    with pytest.raises(ValueError, match=r"rank=4 must be in \[0, world_size=4\)"), fake_process_group(4, 4):
        pass
    assert not dist.is_initialized()


def test_one_rank_creates_no_group():
    with fake_process_group(0, 1) as group:
        assert group is None and not dist.is_initialized()
        assert CPTopology.from_group(group).size == 1
