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
from triton_interpreter import needs_triton_interpreter

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
# Through the autograd Function: a strided per-head view (attention's q_norm input is a chunk of q_proj's output),
# a width past one 4096-element block (one row a program), a frozen weight, a bf16 weight.
for rows, heads, width, frozen in ((6, 3, 64, False), (3, 1, 5000, False), (4, 2, 100, True)):
    norm = ZeroCenteredRMSNorm(width, eps=1e-6, backend="torch")
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.3, generator=gen)
    norm.weight.requires_grad_(not frozen)
    both = torch.randn(rows, heads, 2 * width, generator=gen).requires_grad_()
    dy = torch.randn(rows, heads, width, generator=gen)
    grads = []
    for run in (norm.reference, lambda t: ZeroCenteredRMSNormFunction.apply(t, norm.weight, 1e-6)):
        out = run(both.chunk(2, dim=-1)[0])
        inputs = (both,) if frozen else (both, norm.weight)
        grads.append((out, *torch.autograd.grad(out, inputs, dy)))
    tag = f"{rows}x{heads}x{width}{' frozen' if frozen else ''}"
    for name, got, want in zip(("y", "dx", "dw"), grads[1], grads[0]):
        errors[f"function {name} {tag}"] = rel(got, want)
# What backward keeps of a strided view: a copy of the normed half, not the view's base.
base = torch.randn(5, 2, 128, generator=gen, requires_grad=True)
kept = []
with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
    ZeroCenteredRMSNormFunction.apply(base.chunk(2, dim=-1)[0], torch.zeros(64, requires_grad=True), 1e-6)
storages = {t.untyped_storage().data_ptr() for t in kept}
assert base.untyped_storage().data_ptr() not in storages, "the view's base is kept"
assert sum(t.numel() for t in kept if t.dim() == 2) == 5 * 2 * 64, [tuple(t.shape) for t in kept]
norm = ZeroCenteredRMSNorm(96, eps=1e-6, backend="torch").to(torch.bfloat16)
with torch.no_grad():
    norm.weight.normal_(0.0, 0.3, generator=gen)
x = torch.randn(10, 96, generator=gen).to(torch.bfloat16).requires_grad_()
dy = torch.randn(10, 96, generator=gen).to(torch.bfloat16)
ref = [norm.reference(x)]
ref += torch.autograd.grad(ref[0], (x, norm.weight), dy)
got = [ZeroCenteredRMSNormFunction.apply(x, norm.weight, 1e-6)]
got += torch.autograd.grad(got[0], (x, norm.weight), dy)
for name, g_, w_ in zip(("y", "dx", "dw"), got, ref):
    assert g_.dtype == w_.dtype == torch.bfloat16, (name, g_.dtype)
    errors[f"function bf16 weight {name}"] = rel(g_.float(), w_.float())
# Empty inputs, and operands that do not fit, get a result or one clear error, not a launch.
empty_y, empty_rstd = rms_norm_fwd(torch.randn(0, 64), torch.zeros(64), 1e-6)
empty_dx, empty_dw = rms_norm_bwd(torch.randn(0, 64), torch.randn(0, 64), torch.zeros(64), empty_rstd)
assert empty_y.shape == empty_dx.shape == (0, 64) and torch.equal(empty_dw, torch.zeros(64))
assert swiglu_fwd(torch.randn(0, 8), torch.randn(0, 8)).shape == (0, 8)
for call in (lambda: rms_norm_fwd(torch.randn(4, 64), torch.zeros(32), 1e-6),
             lambda: swiglu_fwd(torch.randn(4, 8), torch.randn(4, 9))):
    try:
        call()
    except ValueError:
        pass
    else:
        raise AssertionError("a misfit operand was launched")
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


@needs_triton_interpreter
def test_norm_and_swiglu_kernels_match_their_references_under_the_interpreter():
    """fp32: output and every gradient within 1e-5 relative of autograd on the torch references (another
    summation order), also through the autograd Function on strided views, past one block's width and with a frozen
    weight; bf16 outputs within one bf16 rounding (the interpreter truncates to bf16 where a GPU rounds, so the
    rounding itself is the GPU test's to check), a bf16 weight's gradients within two; empty inputs and misfit
    operands."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    errors = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(errors) == 3 * 4 + (3 + 3 + 2) + 3 + 3 * 4  # the frozen weight has no dw
    for name, error in errors.items():
        limit = (1.6e-2 if "weight" in name else 8e-3) if "bf16" in name else 1e-5
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

    for dt, wt in (("bf16", "bf16"), ("bf16", "fp32"), ("fp32", "fp32")):
        for width in (256, 1024, 2048, 3000, 5120):
            rows, block, warps = _layout(width)
            layout = {"ROWS": rows, "BLOCK": block}
            norm = {"rows": "i32", "width": "i32"}
            assert compiled(rms_norm_fwd_kernel, {"x": f"*{dt}", "w": f"*{wt}", "y": f"*{dt}", "rstd": "*fp32",
                                                  **norm, "eps": "fp32"}, layout, warps)  # fmt: skip
            for weight_grad in (True, False):
                assert compiled(rms_norm_bwd_kernel, {"x": f"*{dt}", "w": f"*{wt}", "rstd": "*fp32", "dy": f"*{dt}",
                                                      "dx": f"*{dt}", "dw_partial": "*fp32", **norm,
                                                      "blocks_per_program": "i32"},
                                {**layout, "WEIGHT_GRAD": weight_grad}, warps)  # fmt: skip
        if wt != dt:
            continue
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
