"""When the models' own Triton kernels (the loss tiles, the zero-centered RMSNorm, the SwiGLU activation) run."""

from __future__ import annotations

import contextlib
import importlib.util
from functools import cache

import torch

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the kernels compute in fp32


@cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def own_kernels_apply(backend: str, x: torch.Tensor) -> bool:
    """Whether an op with a Triton kernel of ours runs it on tensors like ``x``: any backend but ``"torch"``, CUDA
    tensors, Triton installed. These kernels need no other package, and their configs are fixed (nothing to autotune
    on a cold start). fp64 tensors take the torch paths (the kernels compute in fp32)."""
    return backend != "torch" and x.is_cuda and x.dtype in KERNEL_DTYPES and triton_available()


def launch_device(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """The context a Triton launch on ``x`` runs in: ``x``'s CUDA device current (Triton launches on the current
    device), nothing for CPU tensors (Triton's interpreter)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()
