"""The tiled loss's two per-tile passes, each as torch ops (the reference: any device, any dtype) and as one Triton
kernel (:mod:`cp_models.loss_triton`).

A tile is a [tokens, vocabulary entries] block of logits straight out of the GEMM, fp32 for bf16/fp16/fp32 models.
Forward needs, per token, the tile's row max, its sum of ``exp(logit - max)`` and the logit at the token's label
column: the torch ops read the tile four times and write it twice (amax, sub_, exp_, sum); the kernel reads it once
(an online max with the running sum rescaled). Backward needs ``softmax - onehot`` in the weight's dtype: the torch
ops read and write the fp32 tile twice, scatter the onehot, then cast (sub_, exp_, scatter_add_, to); the kernel
reads the fp32 tile once and writes the cast result. Same arithmetic up to the order of the sum and Triton's exp.
"""

from __future__ import annotations

import os
from typing import Literal

import torch

from cp_core import ContextParallelError
from cp_models.triton_support import KERNEL_DTYPES, launch_device, own_kernels_apply, triton_available

TileKernels = Literal["auto", "torch", "triton"]
TILE_KERNELS: tuple[str, ...] = ("auto", "torch", "triton")
TRITON_BLOCK = 1024  # tile columns a kernel program reads at a time


def tile_stats_torch(
    logits: torch.Tensor, columns: torch.Tensor, row_max: torch.Tensor, exp_sum: torch.Tensor, label_logit: torch.Tensor
) -> None:
    """Write each row's max, sum of exp(logit - max) and label logit (``columns`` [n] int64, in the tile) into the
    [n] outputs; ``logits`` [n, V] is overwritten."""
    label_logit.copy_(logits.gather(1, columns[:, None]).squeeze(1))
    torch.amax(logits, -1, out=row_max)
    torch.sum(logits.sub_(row_max[:, None]).exp_(), -1, out=exp_sum)


def tile_stats_triton(
    logits: torch.Tensor,
    columns: torch.Tensor,
    row_max: torch.Tensor,
    exp_sum: torch.Tensor,
    label_logit: torch.Tensor,
    block: int = TRITON_BLOCK,
) -> None:
    """:func:`tile_stats_torch` as one Triton kernel (``logits`` left as it is)."""
    from cp_models.loss_triton import tile_stats_kernel

    rows, cols = logits.shape
    with launch_device(logits):
        tile_stats_kernel[(rows,)](
            logits, columns, row_max, exp_sum, label_logit, cols, logits.stride(0), BLOCK=block
        )  # fmt: skip


def tile_grad_torch(
    logits: torch.Tensor, lse: torch.Tensor, columns: torch.Tensor, minus_onehot: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``exp(logits - lse) + minus_onehot`` at each row's label column (-1 in the label's tile, else 0), in
    ``dtype``; ``logits`` [n, V] is overwritten."""
    probs = logits.sub_(lse[:, None]).exp_()
    probs.scatter_add_(1, columns[:, None], minus_onehot[:, None])
    return probs.to(dtype)


def tile_grad_triton(
    logits: torch.Tensor,
    lse: torch.Tensor,
    columns: torch.Tensor,
    minus_onehot: torch.Tensor,
    dtype: torch.dtype,
    block: int = TRITON_BLOCK,
) -> torch.Tensor:
    """:func:`tile_grad_torch` as one Triton kernel (``logits`` left as it is)."""
    from cp_models.loss_triton import tile_grad_kernel

    out = torch.empty(logits.shape, dtype=dtype, device=logits.device)
    rows, cols = logits.shape
    with launch_device(logits):
        tile_grad_kernel[(rows,)](
            logits, lse, columns, minus_onehot, out, cols, logits.stride(0), out.stride(0), BLOCK=block
        )  # fmt: skip
    return out


def resolve_tile_kernels(kernels: str, hidden: torch.Tensor) -> str:
    """``"torch"`` or ``"triton"`` for tiles made from ``hidden``: ``"auto"`` takes the Triton kernels for CUDA
    bf16/fp16/fp32 tensors when Triton is installed, else torch's ops; a forced ``"triton"`` that cannot run raises
    one clear error."""
    if kernels not in TILE_KERNELS:
        raise ContextParallelError(f"tile_kernels={kernels!r} is not one of {TILE_KERNELS}")
    if kernels == "auto":
        return "triton" if own_kernels_apply(kernels, hidden) else "torch"
    if kernels == "torch":
        return "torch"
    if hidden.dtype not in KERNEL_DTYPES:
        raise ContextParallelError(
            f"tile_kernels='triton' runs fp32 tiles (bf16, fp16 or fp32 models); hidden is {hidden.dtype}: "
            "use tile_kernels='torch' or 'auto'"
        )
    if not hidden.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ContextParallelError(
            f"tile_kernels='triton' needs CUDA tensors (or Triton's interpreter, TRITON_INTERPRET=1); hidden is on "
            f"{hidden.device}: use tile_kernels='torch' or 'auto'"
        )
    if not triton_available():
        raise ContextParallelError("tile_kernels='triton' needs Triton installed: use tile_kernels='torch' or 'auto'")
    return "triton"
