"""Errors of a result relative to a reference, in fp64."""

from __future__ import annotations

import torch


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
