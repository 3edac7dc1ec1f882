"""Choice between torch reference paths and GPU kernels for the recurrent primitives.

flash-linear-attention is imported only when a CUDA tensor is about to use it: it imports Triton kernels at import
time, which fails on machines without a GPU even when Triton is installed.
"""

from __future__ import annotations

import importlib.util
from functools import cache
from typing import Literal

import torch

from cp_core.errors import ContextParallelError

RecurrentBackend = Literal["auto", "torch", "fla"]
RECURRENT_BACKENDS: tuple[str, ...] = ("auto", "torch", "fla")


@cache
def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


def resolve_recurrent_backend(backend: str, x: torch.Tensor) -> str:
    """``"torch"`` or ``"fla"`` for tensors like ``x``; a forced ``"fla"`` that cannot run raises."""
    if backend not in RECURRENT_BACKENDS:
        raise ContextParallelError(f"unknown recurrent backend {backend!r}; choose one of {RECURRENT_BACKENDS}")
    if backend == "torch":
        return "torch"
    usable = x.is_cuda and fla_available()
    if backend == "fla" and not usable:
        why = "flash-linear-attention is not installed" if not fla_available() else f"tensors are on {x.device}"
        raise ContextParallelError(f"recurrent backend 'fla' needs CUDA tensors and flash-linear-attention ({why})")
    return "fla" if usable else "torch"


def fla_varlen_kwargs(seq_lens, device: torch.device) -> dict[str, torch.Tensor]:
    """fla's varlen arguments: int64 ``cu_seqlens`` on the device plus its CPU copy (spares fla a device read)."""
    from cp_core.packing import cu_seqlens_from_lens

    cu_cpu = cu_seqlens_from_lens(seq_lens).long()
    return {"cu_seqlens": cu_cpu.to(device, non_blocking=True), "cu_seqlens_cpu": cu_cpu}
