"""Precision helpers shared by the recurrent primitives."""

import torch


def upcast(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (fp64 stays fp64, for tight tests): recurrences accumulate in this precision."""
    return x.to(torch.promote_types(x.dtype, torch.float32))
