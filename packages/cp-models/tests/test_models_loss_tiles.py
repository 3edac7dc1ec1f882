"""The tiled loss's Triton tile kernels against their torch references (cp_models.loss_tiles), on the CPU under
Triton's interpreter (TRITON_INTERPRET=1, set before Triton is imported: a subprocess), and the choice's checks.
The CUDA comparison in bf16 is test_models_qwen35_gpu.py::test_tiled_loss_bf16_on_cuda."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest
import torch
from triton_interpreter import needs_triton_interpreter

from cp_core import ContextParallelError
from cp_models import Qwen35ForCausalLM, token_log_probs
from cp_models.loss_tiles import resolve_tile_kernels
from cp_models.presets import tiny_qwen35_config

INTERPRETED = r"""
import json
import torch
from cp_models import token_log_probs
from cp_models.loss_tiles import tile_grad_torch, tile_grad_triton, tile_stats_torch, tile_stats_triton

gen = torch.Generator().manual_seed(0)
errors = {}
# The two passes alone, on tiles wider than the kernel's block (the loop, its masked tail, an all-padding block).
for rows, cols, block in ((5, 100, 32), (3, 64, 32), (4, 7, 16)):
    logits = torch.randn(rows, cols, generator=gen) * 4
    columns = torch.randint(0, cols, (rows,), generator=gen)
    minus_onehot = -(torch.arange(rows) % 2 == 0).float()
    lse = torch.logsumexp(logits, -1) + 0.1
    want = [torch.empty(rows) for _ in range(3)]
    got = [torch.empty(rows) for _ in range(3)]
    tile_stats_torch(logits.clone(), columns, *want)
    tile_stats_triton(logits, columns, *got, block=block)
    errors[f"stats {rows}x{cols}"] = max((g - w).abs().max().item() / w.abs().max().item() for g, w in zip(got, want))
    for dtype in (torch.float32, torch.bfloat16):
        want_grad = tile_grad_torch(logits.clone(), lse, columns, minus_onehot, dtype)
        got_grad = tile_grad_triton(logits, lse, columns, minus_onehot, dtype, block=block)
        errors[f"grad {rows}x{cols} {dtype}"] = (got_grad.float() - want_grad.float()).abs().max().item()
# The whole loss, both loop orders, partial last tiles, ignored labels.
for tokens, vocab, tile in ((37, 101, (8, 16)), (130, 50, (64, 16)), (40, 300, (16, 128))):
    hidden = torch.randn(tokens, 8, generator=gen)
    weight = torch.randn(vocab, 8, generator=gen)
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    labels[::5] = -100
    upstream = torch.randn(tokens, generator=gen)
    results = []
    for kernels in ("torch", "triton"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = token_log_probs(h, w, labels, *tile, tile_kernels=kernels)
        (out * upstream).sum().backward()
        results.append((out, h.grad, w.grad))
    for name, a, b in zip(("out", "hidden", "weight"), *results):
        errors[f"loss {tokens}x{vocab} {name}"] = (a - b).abs().max().item() / b.abs().max().item()
print(json.dumps(errors))
"""


@needs_triton_interpreter
def test_triton_tile_kernels_match_the_torch_passes_under_the_interpreter():
    """fp32: the per-row stats within float rounding of torch's (another summation order), softmax - onehot equal
    up to exp's last bit (and bf16 rounding of that), and the whole loss with either kernels the same forward and
    gradients within 1e-6 relative."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    errors = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(errors) == 3 * 3 + 3 * 3
    for name, error in errors.items():
        limit = 1e-2 if "bfloat16" in name else 1e-6
        assert error <= limit, (name, error)


def test_tile_kernels_choice_is_checked():
    hidden, weight, labels = torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ContextParallelError, match="tile_kernels='cuda' is not one of"):
        token_log_probs(hidden, weight, labels, tile_kernels="cuda")
    with pytest.raises(ContextParallelError, match="runs fp32 tiles"):
        token_log_probs(hidden.double(), weight.double(), labels, tile_kernels="triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ContextParallelError, match="needs CUDA tensors"):
            token_log_probs(hidden, weight, labels, tile_kernels="triton")


def test_auto_takes_torch_where_triton_cannot_run():
    """'auto' picks the Triton kernels only for CUDA tensors of a tile dtype: on CPU (even under the interpreter)
    and for fp64 it runs torch's ops, so the results are the torch path's exactly."""
    cpu = torch.randn(3, 4)
    assert resolve_tile_kernels("auto", cpu) == "torch"
    if importlib.util.find_spec("triton") is not None:  # what "auto" takes on CUDA, without needing one
        for dtype, kernels in ((torch.bfloat16, "triton"), (torch.float32, "triton"), (torch.float64, "torch")):
            assert resolve_tile_kernels("auto", types.SimpleNamespace(is_cuda=True, dtype=dtype)) == kernels
    assert resolve_tile_kernels("auto", cpu.double()) == "torch"
    assert resolve_tile_kernels("torch", cpu) == "torch"
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(9, 8, generator=gen), torch.randn(20, 8, generator=gen)
    labels = torch.randint(0, 20, (9,), generator=gen)
    auto = token_log_probs(hidden, weight, labels, 4, 8)
    assert torch.equal(auto, token_log_probs(hidden, weight, labels, 4, 8, tile_kernels="torch"))


def test_models_run_their_loss_on_their_tile_kernels():
    """A model's ``loss_tile_kernels`` reaches the loss: an impossible choice raises there, the default runs."""
    model = Qwen35ForCausalLM(tiny_qwen35_config(64, hidden_size=32, linear_key_head_dim=8, linear_value_head_dim=8))
    ids = torch.randint(0, 64, (12,))
    assert model.loss_tile_kernels == "auto"
    assert model(ids, [12], labels=ids).token_log_probs.shape == (12,)
    model.loss_tile_kernels = "triton"
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ContextParallelError, match="tile_kernels='triton' needs CUDA tensors"):
            model(ids, [12], labels=ids)
