"""One rank's share of a CP step without the other ranks: torch's ``fake`` process group."""

from __future__ import annotations

import contextlib

import torch.distributed as dist


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
