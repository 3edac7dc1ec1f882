"""The MoE's top-k combine: ``combine_expert_outputs`` against an fp64 index_add_ reference, and each model's
grouped-GEMM expert path (what CUDA bf16 runs; torch's grouped_mm also runs on the CPU) against its per-expert loop,
forward and every gradient, the routing weights' included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import NemotronHConfig, Qwen3_5MoeTextConfig

from cp_core.testing import relative_l2
from cp_models.feed_forward import combine_expert_outputs, expert_slot_groups, sort_by_expert
from cp_models.nemotron_h import NemotronHExperts
from cp_models.qwen3_5 import Qwen35Experts


@pytest.mark.parametrize(
    ("weights_dtype", "outputs_dtype"), [(torch.float64, torch.float64), (torch.float32, torch.bfloat16)]
)
def test_combine_expert_outputs_matches_index_add(weights_dtype, outputs_dtype):
    """Random routing with top-k 3 of 5 experts, tokens whose experts repeat across rows, an expert no token uses."""
    gen = torch.Generator().manual_seed(0)
    tokens, top_k, dim = 41, 3, 8
    experts = torch.rand(tokens, 5, generator=gen).argsort(-1)[:, :top_k]
    experts[experts == 4] = 0  # expert 4 receives nothing; repeated ids across rows stay
    experts[0] = torch.tensor([3, 1, 2])
    weights = torch.rand(tokens, top_k, generator=gen, dtype=torch.float64).to(weights_dtype).requires_grad_()
    order = experts.reshape(-1).argsort(stable=True)
    sorted_outputs = torch.randn(tokens * top_k, dim, generator=gen, dtype=torch.float64).to(outputs_dtype)
    sorted_outputs.requires_grad_()
    upstream = torch.randn(tokens, dim, generator=gen, dtype=torch.float64)

    got = combine_expert_outputs(sorted_outputs, order, weights, torch.float64)
    got_grads = torch.autograd.grad((got * upstream).sum(), [sorted_outputs, weights])
    token = order // top_k
    flat_weights = weights.double().reshape(-1)[order, None]
    ref = torch.zeros(tokens, dim, dtype=torch.float64).index_add_(0, token, sorted_outputs.double() * flat_weights)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), [sorted_outputs, weights])
    tol = 1e-12 if outputs_dtype == torch.float64 else 1e-6  # fp32 accumulation of bf16 outputs and fp32 weights
    assert relative_l2(got, ref) < tol
    for a, b in zip(got_grads, ref_grads, strict=True):
        assert a.dtype == b.dtype and relative_l2(a, b) < tol


def _qwen_experts():
    config = Qwen3_5MoeTextConfig(hidden_size=24, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=16)
    return Qwen35Experts(config), config.hidden_size


def _nemotron_experts():
    config = NemotronHConfig(hidden_size=24, n_routed_experts=6, num_experts_per_tok=3, moe_intermediate_size=16)
    return NemotronHExperts(config), config.hidden_size


@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="torch without grouped_mm")
@pytest.mark.parametrize("build", [_qwen_experts, _nemotron_experts], ids=["qwen3_5", "nemotron_h"])
def test_grouped_expert_path_matches_the_loop(build):
    experts_module, hidden = build()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in experts_module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    tokens = 29
    x = torch.randn(tokens, hidden, generator=gen, requires_grad=True)
    experts = torch.rand(tokens, 6, generator=gen).argsort(-1)[:, :3]
    weights = torch.rand(tokens, 3, generator=gen).softmax(-1).requires_grad_()
    upstream = torch.randn(tokens, hidden, generator=gen)
    inputs = [x, weights, *experts_module.parameters()]
    results = []
    for path in (experts_module._grouped, experts_module._looped):
        out = path(x, experts, weights)
        results.append([out, *torch.autograd.grad((out * upstream).sum(), inputs)])
    for a, b in zip(*results, strict=True):
        assert relative_l2(a, b) < 1e-5


@pytest.mark.parametrize("build", [_qwen_experts, _nemotron_experts], ids=["qwen3_5", "nemotron_h"])
def test_expert_loop_groups_tokens_as_unique_and_where(build):
    """The loop takes each expert's tokens from one sort and one host read of the counts: the same (token, slot)
    groups in the same order as ``torch.where(experts == e)`` per used expert, so the same sums bit for bit."""
    experts_module, hidden = build()
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in experts_module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    tokens = 31
    experts = torch.rand(tokens, 6, generator=gen).argsort(-1)[:, :3]
    experts[experts == 5] = 0  # expert 5 receives nothing
    groups = list(expert_slot_groups(experts, 6))
    assert [e for e, _, _ in groups] == experts.unique().tolist()
    for e, token, slot in groups:
        where_token, where_slot = torch.where(experts == e)
        assert torch.equal(token, where_token) and torch.equal(slot, where_slot)
    order, counts = sort_by_expert(experts, 6)
    assert torch.equal(order, experts.reshape(-1).argsort(stable=True))
    assert torch.equal(counts, torch.bincount(experts.reshape(-1), minlength=6))

    x = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    weights = torch.rand(tokens, 3, generator=gen, dtype=torch.float64).softmax(-1)
    experts_module.double()
    out = torch.zeros_like(x)  # the loop as it read the experts with unique() and torch.where()
    for e in experts.unique().tolist():
        token, slot = torch.where(experts == e)
        w = weights[token, slot, None]
        if isinstance(experts_module, Qwen35Experts):
            gate, up = F.linear(x[token], experts_module.gate_up_proj[e]).chunk(2, dim=-1)
            h = F.linear(F.silu(gate) * up, experts_module.down_proj[e]) * w
        else:
            h = F.linear(
                experts_module.act_fn(F.linear(x[token], experts_module.up_proj[e])), experts_module.down_proj[e]
            )
            h = h * w
        out.index_add_(0, token, h.to(out.dtype))
    assert torch.equal(experts_module._looped(x, experts, weights), out)
