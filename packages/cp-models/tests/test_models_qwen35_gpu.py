"""GPU kernels in the full model agree with the torch path (bf16; skipped without CUDA + fla).

A 4-layer model of the Qwen3.5-0.8B layer shapes (3 GDN + 1 attention layer), one packed row of 4096 tokens in 3
documents, bf16 weights (as FSDP2 mixed precision computes). Fast: fla for GDN and conv, torch varlen attention.
Reference: the same bf16 weights on the torch paths (which upcast the recurrences to fp32 inside), so the
difference is the kernels'. Measured on the H200: fast vs torch-bf16 logits 2.06e-2, worst gradient
A_log 5.4e-2; against an fp32 run fast logits are 2.09e-2 off and torch-bf16 2.18e-2, so the difference is bf16
rounding of weights and activations, not the kernels. Tolerance: logits 3e-2, every parameter gradient 1e-1 (a
first version with 2e-2 / 5e-2 failed on the logits at 2.06e-2). The fast path must also be at least as close to
fp32 as the torch path in bf16, within 25 %.
"""

import pytest
import torch
from transformers import Qwen3_5TextConfig

from cp_core.recurrent_backends import fla_available
from cp_core.testing import kernel_agreement, relative_l2
from cp_models import Qwen35ForCausalLM

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and fla_available()), reason="needs CUDA and flash-linear-attention"
    ),
]


def test_fast_kernels_match_torch_path():
    config = Qwen3_5TextConfig(
        vocab_size=4096,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        tie_word_embeddings=True,
    )
    lens = [2000, 1500, 596]
    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (sum(lens),), device="cuda")

    def make(backend):
        kwargs = {} if backend == "fast" else dict(attention_backend="torch", recurrent_backend="torch")
        with torch.device("cuda"):
            return Qwen35ForCausalLM(config, **kwargs)

    result = kernel_agreement(make, lambda model: model(ids, lens, return_logits=True).logits, log=print)
    print(result)
    assert result.output < 3e-2
    assert result.fast_vs_fp32 <= 1.25 * result.reference_vs_fp32
    assert all(e < 1e-1 for e in result.grads.values()), {n: e for n, e in result.grads.items() if e >= 1e-1}


def test_moe_grouped_gemm_matches_loop():
    """The CUDA grouped-GEMM expert path equals the per-expert loop (bf16; forward and gradients)."""
    from transformers import Qwen3_5MoeTextConfig

    from cp_models.qwen3_5 import Qwen35SparseMoeBlock

    config = Qwen3_5MoeTextConfig(
        hidden_size=1024,
        num_experts=64,
        num_experts_per_tok=8,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=512,
    )
    torch.manual_seed(0)
    block = Qwen35SparseMoeBlock(config).cuda().to(torch.bfloat16)
    for p in block.parameters():  # the stacked experts are created empty (the model's init_weights fills them)
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weights, experts = block.gate(x)
    grads = {}
    for name in ("_grouped", "_looped"):
        block.zero_grad()
        x.grad = None
        out = getattr(block.experts, name)(x, experts, weights.detach())
        out.float().square().sum().backward()
        grads[name] = (out.detach().float(), x.grad.float(), block.experts.gate_up_proj.grad.float())
    errors = [relative_l2(a, b) for a, b in zip(grads["_grouped"], grads["_looped"], strict=True)]
    print(f"moe grouped vs loop: out {errors[0]:.2e}, dx {errors[1]:.2e}, dW {errors[2]:.2e}")
    assert all(e < 1e-2 for e in errors), errors


def test_fused_norm_kernels_match_reference():
    """Our zero-centered RMSNorm kernels (fp32 and bf16 weights, hidden and per-head widths) and fla's gated
    (grouped) RMSNorm equal the torch references in bf16: outputs and grads."""
    from cp_models.norms import GatedRMSNorm, ZeroCenteredRMSNorm

    torch.manual_seed(0)
    cases = [
        (ZeroCenteredRMSNorm(1024), (4096, 1024), False),
        (ZeroCenteredRMSNorm(1024).bfloat16(), (3000, 1024), False),  # the models' bf16 weight, a partial block
        (ZeroCenteredRMSNorm(256).bfloat16(), (4096, 8, 256), False),  # attention's q / k norm: per head
        (GatedRMSNorm(128), (4096, 16, 128), True),  # Qwen3.5 GDN: per head, norm then gate
        (GatedRMSNorm(512, group_size=128, norm_before_gate=False), (4096, 512), True),  # Mamba-2: gate, group norm
    ]
    for norm, shape, gated in cases:
        norm = norm.cuda()
        torch.nn.init.normal_(norm.weight, mean=float(norm.weight.mean()), std=0.1)
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        z = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        results = []
        for fn in (norm.forward, norm.reference):
            x.grad = z.grad = norm.weight.grad = None
            out = fn(x, z) if gated else fn(x)
            out.backward(grad)
            results.append([out, x.grad] + ([z.grad] if gated else []) + [norm.weight.grad])
        errors = [relative_l2(a, b) for a, b in zip(*results, strict=True)]
        print(type(norm).__name__, shape, [f"{e:.1e}" for e in errors])
        assert all(e < 1e-2 for e in errors), errors
        if not gated:  # ours and the reference round the same fp32 value once: at most one bf16 step apart
            ours, ref = results[0][0].float(), results[1][0].float()
            step = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 7)
            assert bool(((ours - ref).abs() <= step).all()), float(((ours - ref).abs() / step).max())


@pytest.mark.parametrize("tile_kernels", ["torch", "triton"])
@pytest.mark.parametrize(("t", "v"), [(3000, 32000), (12000, 8000)], ids=["vocab-outer", "token-outer"])
def test_tiled_loss_bf16_on_cuda(t, v, tile_kernels):
    """The tiled log-prob loss on CUDA (fp32 tiles out of the GEMM, bf16 backward matmuls, fp32 gradient
    accumulation) is as close to the fp64 truth as a plain bf16-logits cross-entropy, within 1.5x; both loop
    orders (fewer tokens than vocabulary and more), with torch's tile passes and with the Triton tile kernels."""
    from cp_models import token_log_probs

    torch.manual_seed(0)
    h = 1024
    hidden64 = torch.randn(t, h, device="cuda", dtype=torch.float64)
    weight64 = torch.randn(v, h, device="cuda", dtype=torch.float64) / 32
    labels = torch.randint(0, v, (t,), device="cuda")
    labels[::5] = -100
    upstream = torch.rand(t, device="cuda", dtype=torch.float64)

    def reference(hidden, weight):
        logp = torch.log_softmax((hidden @ weight.t()).float(), dim=-1)
        return logp.gather(1, labels.clamp_min(0)[:, None]).squeeze(1) * (labels >= 0)

    def run(fn, dtype):
        hidden, weight = hidden64.to(dtype).requires_grad_(), weight64.to(dtype).requires_grad_()
        out = fn(hidden, weight)
        grads = torch.autograd.grad((out.double() * upstream).sum(), [hidden, weight])
        return [out, *grads]

    truth = run(reference, torch.float64)
    ours = run(lambda hid, w: token_log_probs(hid, w, labels, 1024, tile_kernels=tile_kernels), torch.bfloat16)
    plain = run(reference, torch.bfloat16)
    for name, t_, o, p in zip(("fwd", "hidden", "weight"), truth, ours, plain, strict=True):
        print(f"loss {name} ({tile_kernels}): ours {relative_l2(o, t_):.2e}, plain {relative_l2(p, t_):.2e}")
        assert relative_l2(o, t_) <= 1.5 * relative_l2(p, t_) + 1e-6, name
