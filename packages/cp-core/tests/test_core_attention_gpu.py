"""GPU attention backends agree with the torch reference (bf16; skipped without CUDA).

Tolerance: ||fast - ref|| / ||ref|| < 1e-2 for the output and every gradient, where ref is the torch per-document
reference computed in fp32 from the same bf16 inputs (bf16 operands land between 1e-3 and 1e-2).
"""

import pytest
import torch

from cp_core.packing import cu_seqlens_from_lens
from cp_core.testing import relative_l2
from cp_core.varlen_attention import flash_attn_available, varlen_attn_available, varlen_causal_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LAYOUTS = {
    "three_docs": [3000, 1000, 96],
    "tiny_and_long": [1, 2, 3, 4090],
    "many_short": [128] * 32,
}


def _run(backend, q, k, v, cu, max_len, grad, window):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = varlen_causal_attention(q, k, v, cu, max_len, sliding_window=window, backend=backend)
    out.backward(grad.to(out.dtype))
    return out, q.grad, k.grad, v.grad


@pytest.mark.parametrize("backend", ["varlen", "flash_attn"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("heads,dim", [((8, 2), 256), ((16, 16), 128), ((32, 2), 128)])
@pytest.mark.parametrize("window", [None, 257])
def test_fast_backend_matches_reference(backend, layout, heads, dim, window):
    if backend == "varlen" and not varlen_attn_available():
        pytest.skip("torch has no varlen_attn")
    if backend == "flash_attn" and not flash_attn_available():
        pytest.skip("flash-attn not installed")
    torch.manual_seed(0)
    lens = LAYOUTS[layout]
    total, (hq, hkv) = sum(lens), heads
    q = torch.randn(total, hq, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total, hkv, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(total, hkv, dim, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(total, hq, dim, device="cuda")
    cu = cu_seqlens_from_lens(lens)
    fast = _run(backend, q, k, v, cu, max(lens), grad, window)
    ref = _run("torch", q.float(), k.float(), v.float(), cu, max(lens), grad, window)
    for name, a, b in zip(("out", "dq", "dk", "dv"), fast, ref, strict=True):
        assert torch.isfinite(a).all(), name
        assert relative_l2(a, b) < 1e-2, (name, relative_l2(a, b))


@pytest.mark.parametrize("backend", ["varlen", "flash_attn"])
@pytest.mark.parametrize("window", [None, 257])
def test_fast_backend_aligns_shorter_queries_at_the_bottom_right(backend, window):
    """All-gather-KV CP's call: each document's queries are the last of its keys (a rank's piece of a document
    that began on an earlier rank). The kernels must align the causal diagonal at the bottom right, as the
    reference does; top-left alignment would differ by far more than the tolerance."""
    if backend == "varlen" and not varlen_attn_available():
        pytest.skip("torch has no varlen_attn")
    if backend == "flash_attn" and not flash_attn_available():
        pytest.skip("flash-attn not installed")
    torch.manual_seed(0)
    k_lens, q_lens = [3000, 1000, 96, 4096], [1000, 1000, 1, 512]
    q = torch.randn(sum(q_lens), 8, 256, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(k_lens), 2, 256, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(sum(k_lens), 2, 256, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(sum(q_lens), 8, 256, device="cuda")
    cu_q, cu_k = cu_seqlens_from_lens(q_lens), cu_seqlens_from_lens(k_lens)

    def run(backend_, q_, k_, v_):
        q_, k_, v_ = (t.detach().clone().requires_grad_() for t in (q_, k_, v_))
        out = varlen_causal_attention(
            q_, k_, v_, cu_q, max(q_lens), sliding_window=window, backend=backend_, cu_seqlens_k=cu_k,
            max_seqlen_k=max(k_lens),
        )  # fmt: skip
        out.backward(grad.to(out.dtype))
        return out, q_.grad, k_.grad, v_.grad

    fast = run(backend, q, k, v)
    ref = run("torch", q.float(), k.float(), v.float())
    for name, a, b in zip(("out", "dq", "dk", "dv"), fast, ref, strict=True):
        assert torch.isfinite(a).all(), name
        assert relative_l2(a, b) < 1e-2, (name, relative_l2(a, b))


RING_BLOCKS = {  # (query lengths, key lengths or None for the diagonal); max_q == 1 takes flash's swapped GQA path
    "diagonal": ([1000, 3, 2093], None),
    "diagonal_single_tokens": ([1, 1, 1], None),
    "earlier_keys": ([1000, 3, 2093], [517, 2048, 1]),
    "one_query_earlier_keys": ([1], [517]),
}


@pytest.mark.skipif(
    not torch.cuda.is_available() or not torch.backends.cuda.is_flash_attention_available(),
    reason="needs torch's flash attention kernels",
)
@pytest.mark.parametrize("block", list(RING_BLOCKS))
@pytest.mark.parametrize("heads,dim", [((8, 2), 256), ((16, 16), 128)])
def test_ring_flash_block_kernels_match_reference(block, heads, dim):
    """Ring attention's fast block kernels (aten's FlashAttention-2 with the log-sum-exp, and its backward from a
    given output and log-sum-exp) against the torch reference on the same bf16 inputs: the output within the
    tolerance above, the log-sum-exp within 1e-2 absolute, and the backward from the reference's (rounded) output
    and log-sum-exp within the tolerance above."""
    from cp_core.kv_ring import (
        flash_block_backward,
        flash_block_forward,
        reference_block_backward,
        reference_block_forward,
    )

    torch.manual_seed(0)
    q_lens, k_lens = RING_BLOCKS[block]
    causal = k_lens is None
    k_lens = q_lens if causal else k_lens
    (hq, hkv), scale = heads, dim**-0.5
    q = torch.randn(sum(q_lens), hq, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(k_lens), hkv, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(sum(k_lens), hkv, dim, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(sum(q_lens), hq, dim, device="cuda", dtype=torch.bfloat16)
    cu_q, cu_k = (cu_seqlens_from_lens(lens).cuda() for lens in (q_lens, k_lens))
    args = (cu_q, cu_k, max(q_lens), max(k_lens), causal, scale)
    out, lse = flash_block_forward(q, k, v, *args)
    ref_out, ref_lse = reference_block_forward(q, k, v, *args)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and lse.shape == (hq, sum(q_lens))
    assert relative_l2(out, ref_out) < 1e-2, relative_l2(out, ref_out)
    assert (lse - ref_lse).abs().max().item() < 1e-2
    given = (ref_out.bfloat16(), ref_lse.float())
    fast = flash_block_backward(dout, q, k, v, *given, *args)
    ref = reference_block_backward(dout, q, k, v, *given, *args)
    for name, a, b in zip(("dq", "dk", "dv"), fast, ref, strict=True):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        assert torch.isfinite(a).all(), name
        # a single-token document's dq is zero in exact arithmetic (its softmax is 1): both kernels leave
        # rounding noise there, so the error is measured against 1e-3 of dout's norm at the least
        error = relative_l2(a, b, floor=1e-3 * dout.float().norm().item())
        assert error < 1e-2, (name, error)


@pytest.mark.skipif(
    not torch.cuda.is_available() or not torch.backends.cuda.is_flash_attention_available(),
    reason="needs torch's flash attention kernels",
)
def test_ring_attention_fast_path_on_one_rank_matches_reference():
    """The whole ring on one rank of a fake group (8 ranks), fast kernels vs the reference ring, bf16: with every cut
    on a document boundary (no hops: output and every gradient), and rank 0 of one spanning document without
    balancing (its queries read only its own block; the other blocks arrive as the fake group's garbage: output and
    dq only). Tolerance as above."""
    from cp_core import CPTopology, build_packed_metadata, kv_ring_attention
    from cp_core.testing import fake_process_group

    cp, local, hq, hkv, dim = 8, 2048, 8, 2, 256
    cases = {"cuts_on_shards": ([local // 2] * (2 * cp), True, ("out", "dq", "dk", "dv")),
             "rank0_spanning": ([cp * local], False, ("out", "dq"))}  # fmt: skip
    torch.manual_seed(0)
    with fake_process_group(0, cp) as group:
        topology = CPTopology.from_group(group)
        for name, (lens, balance, compared) in cases.items():
            meta = build_packed_metadata(lens, 0, cp)
            inputs = [torch.randn(local, h, dim, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv, hkv)]
            grad = torch.randn(local, hq, dim, device="cuda", dtype=torch.bfloat16)
            results = {}
            for backend in ("auto", "torch"):
                q, k, v = (t.detach().clone().requires_grad_() for t in inputs)
                out = kv_ring_attention(q, k, v, meta, topology, backend=backend, balance=balance)
                out.backward(grad)
                results[backend] = dict(zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), strict=True))
            for tensor in compared:
                fast, ref = results["auto"][tensor], results["torch"][tensor]
                assert torch.isfinite(fast).all(), (name, tensor)
                assert relative_l2(fast, ref) < 1e-2, (name, tensor, relative_l2(fast, ref))
