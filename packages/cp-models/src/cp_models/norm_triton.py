"""The zero-centered RMSNorm (``x / rms(x) * (1 + w)``, fp32 inside) as Triton kernels with configs fixed by the
row width (no autotuning), forward and backward, for :class:`cp_models.norms.ZeroCenteredRMSNorm` on CUDA; its
torch reference is ``ZeroCenteredRMSNorm.reference``. Keeps ``x`` and one fp32 rstd per row for backward."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from cp_models.triton_support import launch_device

ROW_ELEMENTS = 4096  # elements of a [rows, width] block a program holds at a time
MAX_PROGRAMS = 1024  # backward programs, each summing its rows' weight gradient into one fp32 row


@triton.jit
def rms_norm_fwd_kernel(x, w, y, rstd, rows, width, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BLOCK)
    mask = (r[:, None] < rows) & (c[None, :] < width)
    offs = r[:, None] * width + c[None, :]
    xs = tl.load(x + offs, mask=mask, other=0.0).to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(xs * xs, 1) / width + eps)
    scale = 1.0 + tl.load(w + c, mask=c < width, other=0.0).to(tl.float32)
    tl.store(y + offs, (xs * inv[:, None] * scale[None, :]).to(y.dtype.element_ty), mask=mask)
    tl.store(rstd + r, inv, mask=r < rows)


@triton.jit
def rms_norm_bwd_kernel(
    x,
    w,
    rstd,
    dy,
    dx,
    dw_partial,
    rows,
    width,
    blocks_per_program,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    WEIGHT_GRAD: tl.constexpr,
):
    """dx = rstd * ((1 + w) dy - x_hat * mean(x_hat (1 + w) dy)) with x_hat = x * rstd; with ``WEIGHT_GRAD`` each
    program's sum of dy * x_hat over its rows goes to its row of ``dw_partial``."""
    program = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    scale = 1.0 + tl.load(w + c, mask=c < width, other=0.0).to(tl.float32)
    dw = tl.zeros([ROWS, BLOCK], tl.float32)
    for block in range(0, blocks_per_program):
        r = (program * blocks_per_program + block).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        mask = (r[:, None] < rows) & (c[None, :] < width)
        offs = r[:, None] * width + c[None, :]
        inv = tl.load(rstd + r, mask=r < rows, other=0.0)
        x_hat = tl.load(x + offs, mask=mask, other=0.0).to(tl.float32) * inv[:, None]
        g = tl.load(dy + offs, mask=mask, other=0.0).to(tl.float32)
        wg = g * scale[None, :]
        mean = tl.sum(x_hat * wg, 1) / width
        tl.store(dx + offs, ((wg - x_hat * mean[:, None]) * inv[:, None]).to(dx.dtype.element_ty), mask=mask)
        if WEIGHT_GRAD:
            dw += g * x_hat
    if WEIGHT_GRAD:
        tl.store(dw_partial + program * width + c, tl.sum(dw, 0), mask=c < width)


def _layout(width: int) -> tuple[int, int, int]:
    """(rows per block, block width, warps) for rows of ``width``."""
    block = triton.next_power_of_2(width)
    return max(1, ROW_ELEMENTS // block), block, 16 if block >= 8192 else 8


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 1 or weight.numel() != x.size(-1):
        raise ValueError(f"weight of shape {tuple(weight.shape)} does not match rows of width {x.size(-1)}")


@torch.compiler.disable  # opaque to torch.compile: launched as they are
def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)`` for ``x`` [..., width] (``y`` in x's dtype, ``rstd`` fp32 per row)."""
    _check(x, weight)
    width = x.size(-1)
    flat = x.reshape(-1, width).contiguous()
    rows = flat.size(0)
    y, rstd = torch.empty_like(flat), torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        per_block, block, warps = _layout(width)
        with launch_device(x):
            rms_norm_fwd_kernel[(triton.cdiv(rows, per_block),)](
                flat, weight.contiguous(), y, rstd, rows, width, eps, ROWS=per_block, BLOCK=block, num_warps=warps
            )  # fmt: skip
    return y.view(x.shape), rstd


@torch.compiler.disable  # opaque to torch.compile: launched as they are
def rms_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    weight_grad: bool = True,
    max_programs: int = MAX_PROGRAMS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(dx, dw)``: dx in x's dtype, dw (the gradient of the offset ``w``; None without ``weight_grad``) fp32."""
    _check(x, weight)
    width = x.size(-1)
    flat, grad = x.reshape(-1, width).contiguous(), dy.reshape(-1, width).contiguous()
    rows = flat.size(0)
    dx = torch.empty_like(flat)
    if not rows:
        return dx.view(x.shape), (torch.zeros(width, dtype=torch.float32, device=x.device) if weight_grad else None)
    per_block, block, warps = _layout(width)
    blocks = triton.cdiv(rows, per_block)
    blocks_per_program = triton.cdiv(blocks, min(blocks, max_programs))
    programs = triton.cdiv(blocks, blocks_per_program)
    partial = torch.empty(programs if weight_grad else 1, width, dtype=torch.float32, device=x.device)
    with launch_device(x):
        rms_norm_bwd_kernel[(programs,)](
            flat, weight.contiguous(), rstd, grad, dx, partial, rows, width, blocks_per_program, ROWS=per_block,
            BLOCK=block, WEIGHT_GRAD=weight_grad, num_warps=warps,
        )  # fmt: skip
    return dx.view(x.shape), partial.sum(0) if weight_grad else None


class ZeroCenteredRMSNormFunction(torch.autograd.Function):
    """Saves the input as rows of one contiguous tensor: a strided view (attention's q_norm reads half of
    q_proj's output) is copied once, so what backward keeps is the normed part alone, not the view's base."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        rows = x.reshape(-1, x.size(-1)).contiguous()
        y, rstd = rms_norm_fwd(rows, weight, eps)
        ctx.save_for_backward(rows, weight, rstd)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        rows, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_bwd(dy.reshape(rows.shape), rows, weight, rstd, weight_grad=ctx.needs_input_grad[1])
        return dx.view(ctx.shape), None if dw is None else dw.to(weight.dtype), None
