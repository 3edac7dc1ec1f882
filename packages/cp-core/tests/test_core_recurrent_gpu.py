"""flash-linear-attention kernels agree with the torch paths at real shapes (bf16; skipped without CUDA + fla).

The fla path runs on bf16 inputs; the reference is the torch chunked path in fp32 on the same (upcast) inputs.
Tolerance: ||fla - ref|| / ||ref|| < 2e-2 for outputs, final states and every gradient (bf16 operands land between
1e-3 and 1e-2; recurrences over 32k tokens accumulate a little more). The measured errors are printed (`bash
benchmarks/gpu_session.sh` runs these tests) and recorded in docs/benchmarks/recurrent_cp.md.
"""

import pytest
import torch
import torch.nn.functional as F
from gpu_agreement import LENS, TOL, compare, leaves

from cp_core.conv import _fla_causal_conv1d, causal_conv1d_torch
from cp_core.gated_delta import GatedDecay, chunk_gated_delta_rule_torch, gated_delta_rule, prepass_summary
from cp_core.packing import build_packed_metadata
from cp_core.recurrent_backends import fla_available
from cp_core.ssd import chunk_ssd_torch, ssd
from cp_core.testing import relative_l2

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and fla_available()), reason="needs CUDA and flash-linear-attention"
    ),
]


@pytest.mark.parametrize("hk,hv", [(16, 16), (16, 32)])
def test_gated_delta_rule_fla_matches_torch(hk, hv):
    torch.manual_seed(0)
    t, dk, dv = sum(LENS), 128, 128
    base = {
        "q": torch.randn(t, hk, dk, device="cuda"),
        "k": torch.randn(t, hk, dk, device="cuda"),
        "v": torch.randn(t, hv, dv, device="cuda"),
        "a": torch.randn(t, hv, device="cuda"),
        "b": torch.randn(t, hv, device="cuda"),
        "h0": 0.1 * torch.randn(len(LENS), hv, dk, dv, device="cuda"),
    }
    bf16 = {n: (x if n in ("a", "h0") else x.bfloat16()) for n, x in base.items()}

    def run(inputs, backend):
        g = -F.softplus(inputs["a"].float())
        fn = gated_delta_rule if backend == "fla" else chunk_gated_delta_rule_torch
        kwargs = {"backend": "fla"} if backend == "fla" else {}
        cast = (lambda x: x) if backend == "fla" else (lambda x: x.float())
        return fn(
            cast(inputs["q"]),
            cast(inputs["k"]),
            cast(inputs["v"]),
            g,
            cast(inputs["b"]).sigmoid(),
            seq_lens=LENS,
            initial_state=inputs["h0"],
            qk_l2norm=True,
            **kwargs,
        )

    fast_in, ref_in = leaves(bf16), leaves(bf16)
    compare(f"gdn hk={hk} hv={hv}", run(fast_in, "fla"), run(ref_in, "torch"), fast_in, ref_in)


def test_gated_decay_in_fla_kernel_matches_torch():
    """The decay from its inputs inside fla's kernel (``use_gate_in_kernel``; how Qwen3.5 calls it) against the
    torch path: output, final state and the gradients of every input, A_log and dt_bias included."""
    torch.manual_seed(2)
    t, hk, hv, dk, dv = sum(LENS), 16, 32, 128, 128
    base = {
        "q": torch.randn(t, hk, dk, device="cuda"),
        "k": torch.randn(t, hk, dk, device="cuda"),
        "v": torch.randn(t, hv, dv, device="cuda"),
        "a": torch.randn(t, hv, device="cuda"),
        "A_log": torch.rand(hv, device="cuda").mul(16).add(0.01).log(),
        "dt_bias": torch.ones(hv, device="cuda"),
        "b": torch.randn(t, hv, device="cuda"),
        "h0": 0.1 * torch.randn(len(LENS), hv, dk, dv, device="cuda"),
    }
    bf16 = {n: (x if n == "h0" else x.bfloat16()) for n, x in base.items()}

    def run(inputs, backend):
        cast = (lambda x: x) if backend == "fla" else (lambda x: x.float())
        q, k, v, a, a_log, dt_bias, b = (cast(inputs[n]) for n in ("q", "k", "v", "a", "A_log", "dt_bias", "b"))
        return gated_delta_rule(
            q, k, v, GatedDecay(a, a_log, dt_bias), b.sigmoid(), seq_lens=LENS, initial_state=inputs["h0"],
            qk_l2norm=True, backend=backend,
        )  # fmt: skip

    fast_in, ref_in = leaves(bf16), leaves(bf16)
    compare("gdn gated decay in kernel", run(fast_in, "fla"), run(ref_in, "torch"), fast_in, ref_in)


def test_gated_delta_rule_identity_columns_fla_matches_torch():
    """The CP pre-pass: values [v | 0], initial state [0 | I] make the final state [S_ext | M]."""
    torch.manual_seed(1)
    t, h, dk, dv = 384, 16, 128, 128  # short and slowly decaying, so that M is far from 0 (no underflow)
    q, k = (torch.randn(t, h, dk, device="cuda").bfloat16() for _ in range(2))
    v = torch.cat([torch.randn(t, h, dv, device="cuda"), torch.zeros(t, h, dk, device="cuda")], -1).bfloat16()
    g = -F.softplus(torch.randn(t, h, device="cuda")) * 0.002
    beta = torch.rand(t, h, device="cuda").bfloat16()
    eye = torch.eye(dk, device="cuda").expand(1, h, dk, dk)
    init = torch.cat([torch.zeros(1, h, dk, dv, device="cuda"), eye], -1)
    _, fast = gated_delta_rule(q, k, v, g, beta, seq_lens=[t], initial_state=init, qk_l2norm=True, backend="fla")
    _, ref = chunk_gated_delta_rule_torch(
        q.float(), k.float(), v.float(), g, beta.float(), seq_lens=[t], initial_state=init, qk_l2norm=True
    )
    assert ref[..., dv:].abs().max() > 1e-2, "M underflowed: the test would compare zeros"
    errors = {"S_ext": relative_l2(fast[..., :dv], ref[..., :dv]), "M": relative_l2(fast[..., dv:], ref[..., dv:])}
    print("gdn identity columns: " + ", ".join(f"{k}={v:.2e}" for k, v in errors.items()))
    assert all(e < TOL for e in errors.values()), errors


@pytest.mark.parametrize("with_transition", [False, True], ids=["final_state", "with_transition"])
def test_segmented_prepass_fla_matches_whole_and_torch(with_transition):
    """The CP pre-pass in checkpointed 1024-token segments (the last one partial) with fla: its summary [S_ext | M]
    and every input gradient against the one-piece fla run (same kernel, the state carried in fp32 between
    segments: < 1e-3) and against the torch reference (bf16 bound, TOL)."""
    torch.manual_seed(4)
    t, h, dk, dv = 2500, 16, 128, 128  # weak decay and small beta: M stays far from 0 over 2500 tokens
    base = {
        "q": torch.randn(t, h, dk, device="cuda"),
        "k": torch.randn(t, h, dk, device="cuda"),
        "v": torch.randn(t, h, dv, device="cuda"),
        "a": torch.randn(t, h, device="cuda"),
        "b": torch.rand(t, h, device="cuda") * 0.1,
    }
    bf16 = {n: (x if n == "a" else x.bfloat16()) for n, x in base.items()}

    def run(inputs, backend, segment):
        cast = (lambda x: x) if backend == "fla" else (lambda x: x.float())
        g = -F.softplus(inputs["a"]) * 0.001
        return prepass_summary(
            cast(inputs["q"]), cast(inputs["k"]), cast(inputs["v"]), g, cast(inputs["b"]),
            with_transition=with_transition, qk_l2norm=True, backend=backend, segment_tokens=segment,
        )  # fmt: skip

    segmented_in, whole_in, ref_in = leaves(bf16), leaves(bf16), leaves(bf16)
    segmented, whole = run(segmented_in, "fla", 1024), run(whole_in, "fla", None)
    ref = run(ref_in, "torch", 1024)
    assert segmented.shape == (h, dk, dv + (dk if with_transition else 0))
    if with_transition:
        assert ref[..., dv:].abs().max() > 1e-2, "M underflowed: the test would compare zeros"
    grad = torch.randn(segmented.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(5))
    for out in (segmented, whole, ref):
        out.backward(grad)
    errors = {"summary": (relative_l2(segmented, whole), relative_l2(segmented, ref))}
    errors |= {
        f"d{n}": (
            relative_l2(segmented_in[n].grad, whole_in[n].grad),
            relative_l2(segmented_in[n].grad, ref_in[n].grad),
        )
        for n in ("k", "v", "a", "b")  # q only reads the state: the final state does not depend on it
    }
    print(f"segmented pre-pass (vs whole fla, vs torch), transition={with_transition}: "
          + ", ".join(f"{k}={a:.2e}/{b:.2e}" for k, (a, b) in errors.items()))  # fmt: skip
    for inputs in (segmented_in, whole_in):  # fla returns zeros for it, the torch path None
        assert inputs["q"].grad is None or not inputs["q"].grad.any()
    bad = {k: v for k, v in errors.items() if not (v[0] < 1e-3 and v[1] < TOL)}
    assert not bad, bad


def test_ssd_fla_matches_torch():
    torch.manual_seed(2)
    t, h, p, n, groups = sum(LENS), 64, 64, 128, 8
    base = {
        "x": torch.randn(t, h, p, device="cuda"),
        "dt": torch.randn(t, h, device="cuda") - 2.0,
        "A": torch.rand(h, device="cuda") * 2,
        "B": torch.randn(t, groups, n, device="cuda"),
        "C": torch.randn(t, groups, n, device="cuda"),
        "D": torch.randn(h, device="cuda"),
        "h0": 0.1 * torch.randn(len(LENS), h, p, n, device="cuda"),
    }
    bf16 = {name: (x.bfloat16() if name in ("x", "B", "C") else x) for name, x in base.items()}

    def run(inputs, backend):
        dt, a = F.softplus(inputs["dt"]), -inputs["A"].exp()
        if backend == "fla":
            return ssd(
                inputs["x"],
                dt,
                a,
                inputs["B"],
                inputs["C"],
                seq_lens=LENS,
                D=inputs["D"],
                initial_state=inputs["h0"],
                backend="fla",
            )
        return chunk_ssd_torch(
            inputs["x"].float(),
            dt,
            a,
            inputs["B"].float(),
            inputs["C"].float(),
            seq_lens=LENS,
            D=inputs["D"],
            initial_state=inputs["h0"],
        )

    fast_in, ref_in = leaves(bf16), leaves(bf16)
    compare("ssd", run(fast_in, "fla"), run(ref_in, "torch"), fast_in, ref_in)


def test_causal_conv1d_fla_with_halo_matches_torch():
    torch.manual_seed(3)
    lens, dim, width = [16383, 2, 16383], 6144, 4
    meta = build_packed_metadata(lens, cp_rank=1, cp_size=2)  # first local document (2 tokens) began 1 token earlier
    local = meta.local_len
    base = {
        "x": torch.randn(local, dim, device="cuda"),
        "w": torch.randn(dim, width, device="cuda") * 0.5,
        "b": torch.randn(dim, device="cuda"),
        "halo": torch.randn(width - 1, dim, device="cuda"),
    }
    bf16 = {n: x.bfloat16() for n, x in base.items()}
    fast_in, ref_in = leaves(bf16), leaves(bf16)
    fast = _fla_causal_conv1d(
        fast_in["x"],
        fast_in["w"],
        fast_in["b"],
        "silu",
        meta.local_seq_lens,
        fast_in["halo"],
        meta.first_doc_tokens_before,
    )
    ref = causal_conv1d_torch(
        ref_in["x"].float(),
        ref_in["w"].float(),
        ref_in["b"].float(),
        "silu",
        meta.local_position_ids.cuda(),
        ref_in["halo"].float(),
    )
    compare("conv halo", [fast], [ref], fast_in, ref_in)


def _gdn_cp_on_fake_group(rank, cp, total, tensors, segment=16384):
    """``gated_delta_rule_cp`` (fla) for ``rank`` of a fake group, one document spanning the row: output, input
    gradients, and the bytes of the storages autograd keeps for backward (with their data pointers)."""
    from cp_core import CPTopology
    from cp_core.gated_delta import gated_delta_rule_cp
    from cp_core.testing import fake_process_group, saved_storages

    metadata = build_packed_metadata([total], rank, cp)
    with fake_process_group(rank, cp) as group:
        q, k, v, g, beta = tensors()
        topology = CPTopology.from_group(group)
        run = lambda: gated_delta_rule_cp(  # noqa: E731
            q, k, v, g, beta, metadata=metadata, topology=topology, qk_l2norm=True, backend="fla",
            prepass_segment_tokens=segment,
        )  # fmt: skip
        out, saved = saved_storages(run)
        out.float().sum().backward()
    return out, saved, (q, k, v, g, beta)


def _model_like_inputs(t, hk=16, hv=16, dk=128, dv=128, seed=6):
    """q, k, v as views of one conv-output-like bf16 tensor (as Qwen3.5's GDN splits its conv output), g, beta."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    source = torch.randn(t, 2 * hk * dk + hv * dv, device="cuda", generator=gen).bfloat16().requires_grad_()
    a = torch.randn(t, hv, device="cuda", generator=gen).requires_grad_()
    b = torch.randn(t, hv, device="cuda", generator=gen).bfloat16().requires_grad_()

    def tensors():
        mixed = source * 1  # a non-leaf, like the conv output
        q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=1)
        return q.unflatten(1, (hk, dk)), k.unflatten(1, (hk, dk)), v.unflatten(1, (hv, dv)), -F.softplus(a), b.sigmoid()

    return tensors, (source, a, b)


def test_cp_gdn_fla_rank0_matches_the_local_run():
    """Rank 0 on a fake group (its document starts here; the fake recv leaves the passed state's gradient at zero):
    output and input gradients against fla's local run with the normalization inside the kernel. Under CP q and k
    are normalized first (fla's own l2norm, the same kernels, and the pre-pass adds exact zeros here): bitwise."""
    cp, local_t = 4, 8192
    tensors, leaves = _model_like_inputs(local_t)
    out, _, _ = _gdn_cp_on_fake_group(0, cp, cp * local_t, tensors)
    cp_grads = [x.grad.clone() for x in leaves]
    for x in leaves:
        x.grad = None
    q, k, v, g, beta = tensors()
    expected, _ = gated_delta_rule(q, k, v, g, beta, seq_lens=[local_t], qk_l2norm=True, backend="fla")
    expected.float().sum().backward()
    errors = {"out": relative_l2(out, expected)} | {
        f"d{name}": relative_l2(got, x.grad)
        for name, got, x in zip(("source", "a", "b"), cp_grads, leaves, strict=True)
    }
    bitwise = torch.equal(out, expected) and all(torch.equal(c, x.grad) for c, x in zip(cp_grads, leaves, strict=True))
    print(f"cp gdn rank 0 vs local (bitwise {bitwise}): " + ", ".join(f"{n}={e:.2e}" for n, e in errors.items()))
    assert bitwise, errors


def test_cp_gdn_prepass_keeps_no_conv_output():
    """On the ranks that run the pre-pass (0: its last document continues; 1: the state passes through), autograd
    keeps at most g and the carried states more than on the last rank, and never the conv output q, k, v are views
    of: the pre-pass reads the normalized q, k and the contiguous v that the main kernel keeps."""
    cp, local_t = 4, 4096
    tensors, _ = _model_like_inputs(local_t)
    kept = {}
    for rank in (0, 1, cp - 1):
        _, saved, (q, *_rest) = _gdn_cp_on_fake_group(rank, cp, cp * local_t, tensors, segment=1024)
        assert q.untyped_storage().data_ptr() not in saved, f"rank {rank} keeps the conv output"
        kept[rank] = sum(saved.values())
    g_bytes, state_bytes = local_t * 16 * 4, 16 * 128 * 256 * 4
    print(f"kept for backward by rank: { {r: round(b / 2**20, 2) for r, b in kept.items()} } MiB")
    for rank in (0, 1):
        assert kept[rank] - kept[cp - 1] <= g_bytes + 6 * state_bytes, kept
