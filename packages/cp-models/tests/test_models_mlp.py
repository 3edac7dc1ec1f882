"""The MLP output functions that recompute the activation in backward (``swiglu_linear``, ``squared_relu_linear``)
against the plain expressions autograd differentiates: forward and every gradient, what autograd keeps for backward,
and the plain path for any ``down_proj`` that is not a bare ``nn.Linear`` (a LoRA adapter)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from transformers import NemotronHConfig

from cp_core.testing import relative_l2
from cp_models.nemotron_h import NemotronHMLP
from cp_models.qwen3_5 import Qwen35MLP


def _qwen_mlp(bias: bool) -> tuple[nn.Module, int]:
    del bias  # Qwen3.5's MLP has no biases
    return Qwen35MLP(24, 40), 40


def _nemotron_mlp(bias: bool) -> tuple[nn.Module, int]:
    config = NemotronHConfig(hidden_size=24, intermediate_size=40, mlp_hidden_act="relu2", mlp_bias=bias)
    return NemotronHMLP(config), 40


BUILDERS = pytest.mark.parametrize(
    ("build", "bias"),
    [(_qwen_mlp, False), (_nemotron_mlp, False), (_nemotron_mlp, True)],
    ids=["qwen3_5", "nemotron_h", "nemotron_h_bias"],
)


def _init(mlp: nn.Module, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    for p in mlp.parameters():
        p.data = torch.randn(p.shape, generator=gen, dtype=torch.float64).mul_(0.3).to(dtype)
    return mlp.to(dtype)


def _grads(mlp: nn.Module, fn, x: torch.Tensor, upstream: torch.Tensor):
    x = x.detach().requires_grad_()
    out = fn(x)
    params = [p for p in mlp.parameters() if p.requires_grad]
    grads = torch.autograd.grad((out * upstream).sum(), [x, *params])
    return out.detach(), grads


def _saved_bytes(fn, x: torch.Tensor, params: set[int]) -> int:
    """Bytes of the distinct storages autograd keeps after ``fn(x)``, parameters left out."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in params and t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x.detach().requires_grad_())
    return sum(storages.values())


@BUILDERS
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_recomputing_mlp_matches_the_plain_expression(build, bias, dtype):
    """Tokens with negative and positive pre-activations (relu's kink, silu's sign change), a 3-D input."""
    mlp, _ = build(bias)
    _init(mlp, dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 37, 24, generator=gen, dtype=torch.float64).to(dtype)
    upstream = torch.randn(2, 37, 24, generator=gen, dtype=torch.float64).to(dtype)
    out, grads = _grads(mlp, mlp, x, upstream)
    ref_out, ref_grads = _grads(mlp, mlp.reference, x, upstream)
    # The same ops in the same order as autograd (bitwise equal on the CPUs tried); the bound leaves room only for
    # a BLAS that blocks the flattened weight-gradient matmul differently.
    tol = {torch.float64: 1e-15, torch.float32: 1e-7, torch.bfloat16: 4e-3}[dtype]
    assert relative_l2(out, ref_out) <= tol
    assert len(grads) == len(ref_grads) == 1 + len(list(mlp.parameters()))
    for got, want in zip(grads, ref_grads, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert relative_l2(got, want) <= tol, relative_l2(got, want)


@BUILDERS
def test_recomputing_mlp_keeps_less_for_backward(build, bias):
    """Qwen3.5: gate and up (2 x [T, I]) instead of gate, silu(gate), up and the product (4); Nemotron-H: the
    pre-activation (1) instead of relu(x) and its square (2). Both keep the input x for the first projections."""
    mlp, inter = build(bias)
    _init(mlp, torch.float32)
    tokens = 64
    x = torch.randn(tokens, 24)
    params = {id(p) for p in mlp.parameters()} | {p.untyped_storage().data_ptr() for p in mlp.parameters()}
    unit = tokens * inter * 4
    kept_units = 2 if isinstance(mlp, Qwen35MLP) else 1
    assert _saved_bytes(mlp, x, params) == tokens * 24 * 4 + kept_units * unit
    assert _saved_bytes(mlp.reference, x, params) == tokens * 24 * 4 + 2 * kept_units * unit


class _LinearWithHook(nn.Linear):
    """A Linear subclass whose forward does more than F.linear (as a LoRA adapter's does)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


@BUILDERS
def test_a_down_proj_that_is_not_a_plain_linear_runs_as_is(build, bias):
    mlp, inter = build(bias)
    wrapped = _LinearWithHook(inter, 24, bias=bias)
    wrapped.load_state_dict(mlp.down_proj.state_dict())
    mlp.down_proj = wrapped
    _init(mlp, torch.float64)
    x = torch.randn(5, 24, dtype=torch.float64)
    upstream = torch.randn(5, 24, dtype=torch.float64)
    out, grads = _grads(mlp, mlp, x, upstream)
    ref_out, ref_grads = _grads(mlp, mlp.reference, x, upstream)
    assert torch.equal(out, ref_out)
    for got, want in zip(grads, ref_grads, strict=True):
        assert torch.equal(got, want)


@BUILDERS
def test_frozen_down_proj_and_no_grad(build, bias):
    """A frozen down_proj (LoRA elsewhere, or frozen layers) gets no gradient; the other gradients are unchanged.
    Under no_grad the output is the plain expression's."""
    mlp, _ = build(bias)
    _init(mlp, torch.float64)
    x = torch.randn(9, 24, dtype=torch.float64)
    upstream = torch.randn(9, 24, dtype=torch.float64)
    _, full = _grads(mlp, mlp, x, upstream)
    mlp.down_proj.requires_grad_(False)
    _, partial = _grads(mlp, mlp, x, upstream)
    n_down = len(list(mlp.down_proj.parameters()))
    kept = [g for g, p in zip(full[1:], mlp.parameters(), strict=True) if p.requires_grad]
    assert len(partial) == len(full) - n_down
    assert relative_l2(partial[0], full[0]) < 1e-15
    for got, want in zip(partial[1:], kept, strict=True):
        assert relative_l2(got, want) < 1e-15
    with torch.no_grad():
        assert torch.equal(mlp(x), mlp.reference(x))


@BUILDERS
def test_autocast_runs_the_plain_expression(build, bias):
    """Under autocast (fp32 weights, bf16 compute) the Function's backward would multiply a bf16 gradient by the
    fp32 weight; the plain expression, whose graph holds the casts, runs instead: the same output and gradients."""
    mlp, _ = build(bias)
    _init(mlp, torch.float32)
    x = torch.randn(7, 24)
    upstream = torch.randn(7, 24)
    results = []
    for fn in (mlp, mlp.reference):
        inp = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(inp)
        # backward outside autocast, as training loops run it
        results.append((out, torch.autograd.grad((out.float() * upstream).sum(), [inp, *mlp.parameters()])))
    (out, grads), (ref_out, ref_grads) = results
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref_out)
    for got, want in zip(grads, ref_grads, strict=True):
        assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)


@BUILDERS
def test_hooks_on_down_proj_and_the_meta_device(build, bias):
    """A forward hook on down_proj runs (the plain expression calls the module); a forward on the meta device
    (shape inference) works."""
    mlp, _ = build(bias)
    _init(mlp, torch.float64)
    x = torch.randn(6, 24, dtype=torch.float64, requires_grad=True)
    handle = mlp.down_proj.register_forward_hook(lambda module, args, out: out * 0)
    assert torch.count_nonzero(mlp(x)) == 0
    handle.remove()
    assert torch.count_nonzero(mlp(x)) > 0
    meta = build(bias)[0].to("meta")
    assert meta(torch.empty(3, 24, device="meta", requires_grad=True)).shape == (3, 24)


@BUILDERS
@pytest.mark.parametrize("early_stop", [True, False])
def test_recomputing_mlp_under_activation_checkpointing(build, bias, early_stop):
    """Inside torch's non-reentrant checkpoint, where the MLP's Function is the last op saving tensors (early stop
    ends the recomputation there), and with early stop off (what memory-history recording needs on torch 2.11,
    pytorch/pytorch#179536): the plain expression's gradients."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    mlp, _ = build(bias)
    _init(mlp, torch.float64)
    x = torch.randn(11, 24, dtype=torch.float64)
    upstream = torch.randn(11, 24, dtype=torch.float64)
    with set_checkpoint_early_stop(early_stop):
        _, grads = _grads(mlp, lambda inp: inp + checkpoint(mlp, inp, use_reentrant=False), x, upstream)
    _, ref_grads = _grads(mlp, lambda inp: inp + mlp.reference(inp), x, upstream)
    for got, want in zip(grads, ref_grads, strict=True):
        assert relative_l2(got, want) <= 1e-15


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_recomputing_swiglu_on_cuda_bf16_keeps_half_and_matches(backend):
    """The 2B shape's MLP (2048 -> 6144) on 8192 bf16 tokens, with our SwiGLU Triton kernels ("auto") and with
    torch's ops: the same numbers as the plain expression within bf16 rounding (the kernel rounds silu(gate) * up
    once, torch twice; cuBLAS may block the flattened weight-gradient matmul its own way) and, measured by the
    allocator, 2 instead of 4 [T, 6144] tensors kept between forward and backward."""
    hidden, inter, tokens = 2048, 6144, 8192
    mlp = _init(Qwen35MLP(hidden, inter, backend), torch.bfloat16).cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, tokens, hidden, generator=gen, device="cuda", dtype=torch.bfloat16)
    upstream = torch.randn(1, tokens, hidden, generator=gen, device="cuda", dtype=torch.bfloat16)
    out, grads = _grads(mlp, mlp, x, upstream)
    ref_out, ref_grads = _grads(mlp, mlp.reference, x, upstream)
    assert relative_l2(out, ref_out) <= 4e-3
    for got, want in zip(grads, ref_grads, strict=True):
        assert relative_l2(got, want) <= 4e-3, relative_l2(got, want)

    def kept(fn) -> int:
        inp = x.detach().requires_grad_()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = fn(inp)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
        del out
        return held

    unit = tokens * inter * 2
    assert abs(kept(mlp) - 2 * unit) <= unit // 100
    assert abs(kept(mlp.reference) - 4 * unit) <= unit // 100


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_mlp_with_the_swiglu_kernels_matches_eager():
    """``apply_compile`` compiles each block's MLP: with the SwiGLU kernels inside (opaque to torch.compile) the
    compiled MLP gives eager's output and gradients (bf16, two row lengths, the second recompiling)."""
    mlp = _init(Qwen35MLP(256, 768), torch.bfloat16).cuda()
    compiled = torch.compile(mlp)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for tokens in (1000, 4096):
        x = torch.randn(tokens, 256, generator=gen, device="cuda", dtype=torch.bfloat16)
        upstream = torch.randn(tokens, 256, generator=gen, device="cuda", dtype=torch.bfloat16)
        out, grads = _grads(mlp, mlp, x, upstream)
        compiled_out, compiled_grads = _grads(mlp, compiled, x, upstream)
        assert relative_l2(compiled_out, out) <= 4e-3
        for got, want in zip(compiled_grads, grads, strict=True):
            assert relative_l2(got, want) <= 4e-3, relative_l2(got, want)


def _fake_swiglu_kernels(monkeypatch) -> list[str]:
    """Our two SwiGLU kernels as torch code with their contract (``swiglu_fwd(x, y)`` = silu(x) * y,
    ``swiglu_bwd(x, y, g)`` = (d/dx, d/dy) of it against g), so the fused path's wiring runs on the CPU in fp64."""
    import sys
    import types

    calls: list[str] = []

    def swiglu_fwd(x, y):
        calls.append("fwd")
        return torch.nn.functional.silu(x) * y

    def swiglu_bwd(x, y, g):
        calls.append("bwd")
        s = torch.sigmoid(x)
        return g * s * (1 + x * (1 - s)) * y, g * x * s

    kernels = types.ModuleType("cp_models.swiglu_triton")
    kernels.swiglu_fwd, kernels.swiglu_bwd = swiglu_fwd, swiglu_bwd
    monkeypatch.setitem(sys.modules, "cp_models.swiglu_triton", kernels)
    monkeypatch.setattr("cp_models.feed_forward.own_kernels_apply", lambda backend, x: True)
    return calls


@pytest.mark.parametrize("frozen_down", [False, True])
def test_fused_swiglu_path_gives_the_plain_expressions_gradients(monkeypatch, frozen_down):
    """The path that runs our SwiGLU kernels on CUDA, with those kernels replaced by their torch contract (fp64):
    the output and every gradient of the plain expression, with and without down_proj's gradient; forward takes
    one kernel and backward two (the recomputed product only when down_proj needs its gradient)."""
    calls = _fake_swiglu_kernels(monkeypatch)
    mlp = _init(Qwen35MLP(24, 40), torch.float64)
    mlp.down_proj.requires_grad_(not frozen_down)
    x = torch.randn(9, 24, dtype=torch.float64)
    upstream = torch.randn(9, 24, dtype=torch.float64)
    out, grads = _grads(mlp, mlp, x, upstream)
    assert calls == (["fwd", "bwd"] if frozen_down else ["fwd", "fwd", "bwd"])
    ref_out, ref_grads = _grads(mlp, mlp.reference, x, upstream)
    assert relative_l2(out, ref_out) < 1e-15
    assert len(grads) == len(ref_grads) == 1 + len([p for p in mlp.parameters() if p.requires_grad])
    for got, want in zip(grads, ref_grads, strict=True):
        assert relative_l2(got, want) < 1e-14
