"""Context-parallel topology: which process group shards the sequence, and where this rank sits in it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

from cp_core.errors import ContextParallelError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class CPTopology:
    """Immutable description of a context-parallel group.

    ``group`` is None only for the unsharded case (``size == 1``), where no collective is ever issued.
    Rank ``r`` owns the contiguous token range ``[r * S / size, (r + 1) * S / size)`` of every packed row.
    """

    group: dist.ProcessGroup | None
    rank: int
    size: int

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ContextParallelError(f"CP size must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ContextParallelError(f"CP rank {self.rank} is outside [0, {self.size})")
        if self.size > 1 and self.group is None:
            raise ContextParallelError(f"CP size {self.size} > 1 needs a process group")

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @classmethod
    def single(cls) -> CPTopology:
        """No context parallelism: one rank holds the whole row."""
        return cls(group=None, rank=0, size=1)

    @classmethod
    def from_group(cls, group: dist.ProcessGroup | None = None) -> CPTopology:
        """Topology over ``group`` (the default group when None); a group of one rank gives ``single()``."""
        if not dist.is_initialized():
            if group is not None:
                raise ContextParallelError("a process group was given but torch.distributed is not initialized")
            return cls.single()
        group = group if group is not None else dist.group.WORLD
        size = dist.get_world_size(group)
        if size == 1:
            return cls.single()
        return cls(group=group, rank=dist.get_rank(group), size=size)

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh, dim: str | int = "cp") -> CPTopology:
        """Topology over one dimension of a DeviceMesh (by name or index)."""
        if mesh.ndim == 1 and isinstance(dim, str) and mesh.mesh_dim_names in (None, (dim,)):
            return cls.from_group(mesh.get_group())
        return cls.from_group(mesh.get_group(dim))

    def shard_range(self, total: int) -> tuple[int, int]:
        """Token range ``[start, end)`` of this rank in a row of ``total`` tokens (total % size == 0)."""
        local = total // self.size
        return self.rank * local, (self.rank + 1) * local
