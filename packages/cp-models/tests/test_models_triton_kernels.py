"""The zero-centered RMSNorm and SwiGLU Triton kernels (cp_models.norm_triton, cp_models.swiglu_triton) against
their torch references, on the CPU under Triton's interpreter (TRITON_INTERPRET=1, set before Triton is imported: a
subprocess). The CUDA bf16 comparisons are in test_models_qwen35_gpu.py and test_models_mlp.py."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from cp_models.norms import ZeroCenteredRMSNorm
from cp_models.triton_support import own_kernels_apply

INTERPRETED = r"""
import json
import torch
import torch.nn.functional as F
from cp_models.norms import ZeroCenteredRMSNorm
from cp_models.norm_triton import ZeroCenteredRMSNormFunction, rms_norm_bwd, rms_norm_fwd
from cp_models.swiglu_triton import swiglu_bwd, swiglu_fwd

gen = torch.Generator().manual_seed(0)
errors = {}


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


# Widths below, at and above a power of two; row counts that leave a partial block; a backward whose programs
# each loop over several blocks (max_programs=2) and one program per block.
for rows, width, max_programs in ((70, 100, 2), (5, 64, 1024), (9, 300, 4)):
    norm = ZeroCenteredRMSNorm(width, eps=1e-6, backend="torch")
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.3, generator=gen)
    x = (torch.randn(rows, width, generator=gen) * 3).requires_grad_()
    dy = torch.randn(rows, width, generator=gen)
    want = norm.reference(x)
    want_dx, want_dw = torch.autograd.grad(want, (x, norm.weight), dy)
    y, rstd = rms_norm_fwd(x.detach(), norm.weight.detach(), 1e-6)
    dx, dw = rms_norm_bwd(dy, x.detach(), norm.weight.detach(), rstd, max_programs=max_programs)
    tag = f"{rows}x{width}"
    errors[f"norm y {tag}"] = rel(y, want)
    errors[f"norm dx {tag}"] = rel(dx, want_dx)
    errors[f"norm dw {tag}"] = rel(dw, want_dw)
    # the autograd Function on a 3-D input (heads), bf16: rounded once, like the reference
    x3 = x.detach().view(rows, 1, width).to(torch.bfloat16).requires_grad_()
    out = ZeroCenteredRMSNormFunction.apply(x3, norm.weight.detach().requires_grad_(), 1e-6)
    errors[f"norm bf16 y {tag}"] = rel(out.float(), norm.reference(x3.detach()).float())
for shape in ((7, 300), (3, 1024), (2, 5, 11)):
    g = (torch.randn(*shape, generator=gen) * 3).requires_grad_()
    u = torch.randn(*shape, generator=gen).requires_grad_()
    d = torch.randn(*shape, generator=gen)
    want = F.silu(g) * u
    want_dg, want_du = torch.autograd.grad(want, (g, u), d)
    got_dg, got_du = swiglu_bwd(g.detach(), u.detach(), d)
    tag = "x".join(map(str, shape))
    errors[f"swiglu act {tag}"] = rel(swiglu_fwd(g.detach(), u.detach()), want)
    errors[f"swiglu dgate {tag}"] = rel(got_dg, want_dg)
    errors[f"swiglu dup {tag}"] = rel(got_du, want_du)
    bf = [t.detach().to(torch.bfloat16) for t in (g, u)]
    errors[f"swiglu bf16 act {tag}"] = rel(swiglu_fwd(*bf).float(), F.silu(bf[0].float()) * bf[1].float())
print(json.dumps(errors))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter runs on CPU)")
def test_norm_and_swiglu_kernels_match_their_references_under_the_interpreter():
    """fp32: output and every gradient within 1e-5 relative of autograd on the torch references (another
    summation order); bf16 outputs within one bf16 rounding."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    errors = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(errors) == 3 * 4 + 3 * 4
    for name, error in errors.items():
        limit = 8e-3 if "bf16" in name else 1e-5
        assert error <= limit, (name, error)


def test_own_kernels_run_only_where_they_can():
    """CUDA tensors of a kernel dtype with any backend but "torch"; the CPU, fp64 and "torch" take the references."""
    assert not own_kernels_apply("auto", torch.randn(2, 4))
    assert not own_kernels_apply("fla", torch.randn(2, 4))
    if torch.cuda.is_available():
        assert own_kernels_apply("auto", torch.randn(2, 4, device="cuda"))
        assert not own_kernels_apply("torch", torch.randn(2, 4, device="cuda"))
        assert not own_kernels_apply("auto", torch.randn(2, 4, device="cuda", dtype=torch.float64))
    norm = ZeroCenteredRMSNorm(4)
    x = torch.randn(3, 4)
    assert torch.equal(norm(x), norm.reference(x))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_kernels_compile_for_hopper():
    """Every kernel of ours, at the configs the models launch (bf16 and fp32; the norm at per-head and hidden
    widths), compiles to an sm_90 binary through Triton's whole pipeline (ptxas included), without a GPU: the
    interpreter test checks what they compute, this one that the compiler takes them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from cp_models.loss_triton import tile_grad_kernel, tile_stats_kernel
    from cp_models.norm_triton import _layout, rms_norm_bwd_kernel, rms_norm_fwd_kernel
    from cp_models.swiglu_triton import BLOCK, NUM_WARPS, swiglu_bwd_kernel, swiglu_fwd_kernel

    def compiled(fn, types: dict[str, str], constants: dict[str, int], warps: int) -> int:
        signature = {**types, **dict.fromkeys(constants, "constexpr")}
        source = ASTSource(fn=fn, signature=signature, constexprs=constants)
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        return len(kernel.asm["cubin"])

    for dt in ("bf16", "fp32"):
        for width in (256, 1024, 2048, 3000):
            rows, block, warps = _layout(width)
            layout = {"ROWS": rows, "BLOCK": block}
            norm = {"rows": "i32", "width": "i32"}
            assert compiled(rms_norm_fwd_kernel, {"x": f"*{dt}", "w": f"*{dt}", "y": f"*{dt}", "rstd": "*fp32",
                                                  **norm, "eps": "fp32"}, layout, warps)  # fmt: skip
            assert compiled(rms_norm_bwd_kernel, {"x": f"*{dt}", "w": f"*{dt}", "rstd": "*fp32", "dy": f"*{dt}",
                                                  "dx": f"*{dt}", "dw_partial": "*fp32", **norm,
                                                  "blocks_per_program": "i32"}, layout, warps)  # fmt: skip
        flat = {"n": "i32"}
        assert compiled(swiglu_fwd_kernel, {"gate": f"*{dt}", "up": f"*{dt}", "out": f"*{dt}", **flat},
                        {"BLOCK": BLOCK}, NUM_WARPS)  # fmt: skip
        assert compiled(swiglu_bwd_kernel, {"gate": f"*{dt}", "up": f"*{dt}", "grad_act": f"*{dt}",
                                            "grad_gate": f"*{dt}", "grad_up": f"*{dt}", **flat},
                        {"BLOCK": BLOCK}, NUM_WARPS)  # fmt: skip
        tile = {"n_cols": "i32", "stride_row": "i32"}
        assert compiled(tile_stats_kernel, {"logits": "*fp32", "columns": "*i64", "row_max": "*fp32",
                                            "exp_sum": "*fp32", "label_logit": "*fp32", **tile}, {"BLOCK": 1024}, 4)  # fmt: skip
        assert compiled(tile_grad_kernel, {"logits": "*fp32", "lse": "*fp32", "columns": "*i64",
                                           "minus_onehot": "*fp32", "out": f"*{dt}", **tile, "stride_out": "i32"},
                        {"BLOCK": 1024}, 4)  # fmt: skip
