"""SwiGLU's elementwise passes as Triton kernels with one fixed config (no autotuning), for
:func:`cp_models.feed_forward.swiglu_linear` on CUDA: ``silu(gate) * up`` and its two input gradients, each computed
in fp32 and rounded once into the inputs' dtype. The torch expressions they replace are in feed_forward.py."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cp_models.triton_support import launch_device

BLOCK = 1024  # elements a program handles
NUM_WARPS = 4


@triton.jit
def swiglu_fwd_kernel(gate, up, out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + offs, (g * tl.sigmoid(g) * u).to(out.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_bwd_kernel(gate, up, grad_act, grad_gate, grad_up, n, BLOCK: tl.constexpr):
    """d/dgate = grad * up * s * (1 + gate * (1 - s)) with s = sigmoid(gate); d/dup = grad * silu(gate)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up + offs, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(grad_act + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    tl.store(grad_gate + offs, (d * u * s * (1.0 + g * (1.0 - s))).to(grad_gate.dtype.element_ty), mask=mask)
    tl.store(grad_up + offs, (d * g * s).to(grad_up.dtype.element_ty), mask=mask)


def _flat(*tensors: torch.Tensor) -> list[torch.Tensor]:
    if len({t.shape for t in tensors}) != 1:
        raise ValueError(f"SwiGLU operands differ in shape: {[tuple(t.shape) for t in tensors]}")
    return [t.contiguous() for t in tensors]


@torch.compiler.disable  # opaque to torch.compile: launched as they are
def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (same shape and dtype as ``gate``)."""
    gate, up = _flat(gate, up)
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        with launch_device(gate):
            swiglu_fwd_kernel[(triton.cdiv(n, BLOCK),)](gate, up, out, n, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return out


@torch.compiler.disable  # opaque to torch.compile: launched as they are
def swiglu_bwd(gate: torch.Tensor, up: torch.Tensor, grad_act: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``silu(gate) * up`` with respect to ``gate`` and ``up`` against ``grad_act``."""
    gate, up, grad_act = _flat(gate, up, grad_act)
    grad_gate, grad_up = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    if n:
        with launch_device(gate):
            swiglu_bwd_kernel[(triton.cdiv(n, BLOCK),)](
                gate, up, grad_act, grad_gate, grad_up, n, BLOCK=BLOCK, num_warps=NUM_WARPS
            )  # fmt: skip
    return grad_gate, grad_up
