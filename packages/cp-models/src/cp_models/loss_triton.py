"""Triton kernels of the tiled loss's two per-tile passes (see :mod:`cp_models.loss_tiles` for their torch
references and the wrappers). Imported only when a caller asks for them: Triton is not installed everywhere."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_stats_kernel(
    logits, columns, row_max, exp_sum, label_logit, n_cols, stride_row, BLOCK: tl.constexpr
):  # fmt: skip
    """One program per tile row: the row's max, its sum of exp(x - max) (an online max with the running sum
    rescaled, so the row is read once) and the logit at the row's label column."""
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride_row
    running_max = tl.full([BLOCK], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < n_cols, other=float("-inf"))
        new_max = tl.maximum(running_max, x)
        empty = new_max == float("-inf")  # lanes that have seen only padding: keep 0, not exp(-inf + inf) = nan
        rescale = tl.where(empty, 0.0, tl.exp(running_max - new_max))
        running_sum = running_sum * rescale + tl.where(empty, 0.0, tl.exp(x - new_max))
        running_max = new_max
    total_max = tl.max(running_max, 0)
    total = tl.sum(running_sum * tl.exp(running_max - total_max), 0)
    tl.store(row_max + row, total_max)
    tl.store(exp_sum + row, total)
    tl.store(label_logit + row, tl.load(base + tl.load(columns + row)))


@triton.jit
def tile_grad_kernel(
    logits, lse, columns, minus_onehot, out, n_cols, stride_row, stride_out, BLOCK: tl.constexpr
):  # fmt: skip
    """One program per tile row: exp(x - lse) plus the row's -1 (or 0) at its label column, in fp32, stored in
    ``out``'s dtype: softmax - onehot, the tile's part of d logits before the upstream gradient."""
    row = tl.program_id(0).to(tl.int64)
    row_lse = tl.load(lse + row)
    column = tl.load(columns + row)
    onehot = tl.load(minus_onehot + row)
    for start in range(0, n_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n_cols
        p = tl.exp(tl.load(logits + row * stride_row + offs, mask=mask, other=0.0) - row_lse)
        p = tl.where(offs == column, p + onehot, p)
        tl.store(out + row * stride_out + offs, p.to(out.dtype.element_ty), mask=mask)
