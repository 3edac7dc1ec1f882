"""Choice between torch reference paths and GPU kernels for the recurrent primitives.

Backends: ``"torch"`` (the reference paths, any device), ``"fla"`` (flash-linear-attention: conv, SSD, gated delta,
gated norm), ``"mamba_ssm"`` (mamba-ssm's Triton SSD and causal-conv1d's CUDA conv for Mamba-2 layers; the ops
those packages lack run as under ``"auto"``), and ``"auto"``, which picks per op the fastest kernel installed by
the table in docs/benchmarks/recurrent_kernels.md (:data:`AUTO_ORDER`).

The kernel packages are imported only when a CUDA tensor is about to use them: fla imports Triton kernels at import
time, which fails on machines without a GPU even when Triton is installed.
"""

from __future__ import annotations

import importlib.util
import re
from functools import cache
from typing import Literal

import torch

from cp_core.errors import ContextParallelError

RecurrentBackend = Literal["auto", "torch", "fla", "mamba_ssm"]
RECURRENT_BACKENDS: tuple[str, ...] = ("auto", "torch", "fla", "mamba_ssm")
KernelOp = Literal["conv", "ssd", "gated_delta", "norm"]

# Per op, the kernels "auto" tries in order on CUDA tensors (then torch): the fastest first by
# docs/benchmarks/recurrent_kernels.md (fla ahead of causal-conv1d and mamba-ssm at 8k-128k on H100).
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "conv": ("fla", "mamba_ssm"),
    "ssd": ("fla", "mamba_ssm"),
    "gated_delta": ("fla",),
    "norm": ("fla",),
}
_MAMBA_SSM_OPS = ("conv", "ssd")


@cache
def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


@cache
def mamba_ssm_available() -> bool:
    """mamba-ssm (its SSD) and causal-conv1d (its conv) both installed: the pair that Mamba-2 layers use."""
    return importlib.util.find_spec("mamba_ssm") is not None and importlib.util.find_spec("causal_conv1d") is not None


def _installed(kernel: str) -> bool:
    return fla_available() if kernel == "fla" else mamba_ssm_available()


_PACKAGES = {"fla": "flash-linear-attention", "mamba_ssm": "mamba-ssm and causal-conv1d"}


def resolve_recurrent_backend(backend: str, x: torch.Tensor, op: KernelOp = "gated_delta") -> str:
    """``"torch"``, ``"fla"`` or ``"mamba_ssm"`` for ``op`` on tensors like ``x``; a forced kernel that cannot run
    raises."""
    if backend not in RECURRENT_BACKENDS:
        raise ContextParallelError(f"unknown recurrent backend {backend!r}; choose one of {RECURRENT_BACKENDS}")
    if op not in AUTO_ORDER:
        raise ContextParallelError(f"unknown kernel op {op!r}; choose one of {tuple(AUTO_ORDER)}")
    if backend == "torch":
        return "torch"
    if backend == "auto" or (backend == "mamba_ssm" and op not in _MAMBA_SSM_OPS):
        if x.is_cuda:
            for kernel in AUTO_ORDER[op]:
                if _installed(kernel):
                    return kernel
        return "torch"
    if not (x.is_cuda and _installed(backend)):
        why = f"{_PACKAGES[backend]} not installed" if not _installed(backend) else f"tensors are on {x.device}"
        raise ContextParallelError(
            f"recurrent backend {backend!r} needs CUDA tensors and {_PACKAGES[backend]} ({why}); "
            "use recurrent_backend 'auto' or 'torch'"
        )
    return backend


# fla refuses its gated chunk backward (GDN, and the SSD it runs as gated linear attention) on Hopper GPUs with these
# Triton versions, whose compiler gets it wrong; with tilelang installed it sends GDN's to tilelang instead (not the
# SSD's: tilelang's kernel takes no fp32 states).
FLA_HOPPER_TRITON_REFUSED = ((3, 4, 0), (3, 7, 1))  # [from, to)


def _triton_version() -> tuple[str, tuple[int, ...]] | None:
    try:
        import triton
    except ImportError:
        return None
    numbers = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", triton.__version__)
    if numbers is None:
        return None
    return triton.__version__, tuple(int(n or 0) for n in numbers.groups())


def fla_backward_problem(device: int = 0, *, ssd: bool = True) -> str | None:
    """Why fla's kernels cannot train on CUDA device ``device`` here, or None: its gated backward with Triton
    >= 3.4 and < 3.7.1 on a Hopper GPU, which fla refuses in the first backward; known before any model loads.
    ``ssd``: whether fla's SSD (Mamba-2 layers) trains too, which tilelang cannot take over."""
    if not fla_available() or not torch.cuda.is_available():
        return None
    if not ssd and importlib.util.find_spec("tilelang") is not None:
        return None
    found = _triton_version()
    low, high = FLA_HOPPER_TRITON_REFUSED
    if found is None or not low <= found[1] < high:
        return None
    name = torch.cuda.get_device_name(device)
    if "NVIDIA H" not in name and torch.cuda.get_device_capability(device)[0] != 9:  # fla's test for Hopper
        return None
    return (
        f"Triton {found[0]} on {name} (Hopper): fla's gated backward is wrong with Triton >= 3.4 and < 3.7.1 and fla "
        "refuses it; install triton>=3.7.1 (pip install -U 'triton>=3.7.1')"
    )
