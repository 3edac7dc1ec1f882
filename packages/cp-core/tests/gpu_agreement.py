"""Shared by the GPU kernel tests: a kernel on bf16 inputs against the torch path in fp32, outputs and every
gradient within ``TOL`` relative L2 (bf16 operands land between 1e-3 and 1e-2; recurrences over 32k tokens
accumulate a little more)."""

import torch

from cp_core.testing import relative_l2

TOL = 2e-2
LENS = [20000, 8000, 4000, 768]  # 32k tokens, 4 documents


def leaves(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone().requires_grad_() for n, t in tensors.items()}


def compare(name, fast_out, ref_out, fast_in, ref_in, seed=1):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    grads = [torch.randn(o.shape, device="cuda", generator=gen) for o in ref_out]
    torch.autograd.backward([o.float() for o in fast_out], grads)
    torch.autograd.backward([o.float() for o in ref_out], grads)
    errors = {f"out{i}": relative_l2(f, r) for i, (f, r) in enumerate(zip(fast_out, ref_out, strict=True))}
    errors |= {f"d{n}": relative_l2(fast_in[n].grad, ref_in[n].grad) for n in ref_in if ref_in[n].grad is not None}
    print(f"{name}: " + ", ".join(f"{k}={v:.2e}" for k, v in errors.items()))
    bad = {k: v for k, v in errors.items() if not v < TOL}
    assert not bad, f"{name}: relative errors above {TOL}: {bad}"
