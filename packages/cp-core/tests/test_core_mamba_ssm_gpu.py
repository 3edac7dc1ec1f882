"""mamba-ssm's SSD and causal-conv1d's conv agree with the torch paths at real shapes (bf16; skipped without CUDA,
mamba-ssm and causal-conv1d).

The kernels run on bf16 inputs; the reference is the torch path in fp32 on the same (upcast) inputs, over documents
that restart the recurrence (4 documents, 32k tokens), with per-document initial states and a CP halo.
Tolerance: ||kernel - ref|| / ||ref|| < 2e-2 for outputs, final states and every gradient, as for fla's kernels.
"""

import pytest
import torch
import torch.nn.functional as F
from gpu_agreement import LENS, compare, leaves

from cp_core.conv import _mamba_causal_conv1d, causal_conv1d, causal_conv1d_torch
from cp_core.packing import build_packed_metadata, position_ids_from_seq_lens
from cp_core.recurrent_backends import mamba_ssm_available
from cp_core.ssd import chunk_ssd_torch, ssd

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and mamba_ssm_available()), reason="needs CUDA, mamba-ssm and causal-conv1d"
    ),
]


@pytest.mark.parametrize("with_initial_state", [False, True])
def test_ssd_mamba_ssm_matches_torch(with_initial_state):
    torch.manual_seed(2)
    t, h, p, n, groups = sum(LENS), 64, 64, 128, 8
    base = {
        "x": torch.randn(t, h, p, device="cuda"),
        "dt": torch.randn(t, h, device="cuda") - 2.0,
        "A": torch.rand(h, device="cuda") * 2,
        "B": torch.randn(t, groups, n, device="cuda"),
        "C": torch.randn(t, groups, n, device="cuda"),
        "D": torch.randn(h, device="cuda"),
    }
    if with_initial_state:
        base["h0"] = 0.1 * torch.randn(len(LENS), h, p, n, device="cuda")
    bf16 = {name: (x.bfloat16() if name in ("x", "B", "C") else x) for name, x in base.items()}

    def run(inputs, backend):
        cast = (lambda v: v) if backend == "mamba_ssm" else (lambda v: v.float())
        fn = ssd if backend == "mamba_ssm" else chunk_ssd_torch
        kwargs = {"backend": "mamba_ssm"} if backend == "mamba_ssm" else {}
        return fn(
            cast(inputs["x"]),
            F.softplus(inputs["dt"]),
            -inputs["A"].exp(),
            cast(inputs["B"]),
            cast(inputs["C"]),
            seq_lens=LENS,
            D=inputs["D"],
            initial_state=inputs.get("h0"),
            **kwargs,
        )

    fast_in, ref_in = leaves(bf16), leaves(bf16)
    compare(f"ssd mamba-ssm (initial state {with_initial_state})", run(fast_in, "mamba_ssm"), run(ref_in, "torch"),
             fast_in, ref_in)  # fmt: skip


def test_causal_conv1d_mamba_ssm_with_halo_matches_torch():
    torch.manual_seed(3)
    lens, dim, width = [16383, 2, 16383], 6144, 4
    meta = build_packed_metadata(lens, cp_rank=1, cp_size=2)  # first local document (2 tokens) began 1 token earlier
    base = {
        "x": torch.randn(meta.local_len, dim, device="cuda"),
        "w": torch.randn(dim, width, device="cuda") * 0.5,
        "b": torch.randn(dim, device="cuda"),
        "halo": torch.randn(width - 1, dim, device="cuda"),
    }
    bf16 = {n: x.bfloat16() for n, x in base.items()}
    fast_in, ref_in = leaves(bf16), leaves(bf16)
    fast = _mamba_causal_conv1d(fast_in["x"], fast_in["w"], fast_in["b"], "silu", meta.local_seq_lens,
                                fast_in["halo"], meta.first_doc_tokens_before)  # fmt: skip
    ref = causal_conv1d_torch(ref_in["x"].float(), ref_in["w"].float(), ref_in["b"].float(), "silu",
                              meta.local_position_ids.cuda(), ref_in["halo"].float())  # fmt: skip
    compare("conv halo (causal-conv1d)", [fast], [ref], fast_in, ref_in)


def test_causal_conv1d_mamba_ssm_resets_at_documents():
    """Documents shorter than the conv width, and one token long, restart the conv exactly."""
    torch.manual_seed(4)
    lens, dim, width = [1, 2, 3, 4090, 1, 4000], 256, 4
    base = {
        "x": torch.randn(sum(lens), dim, device="cuda"),
        "w": torch.randn(dim, width, device="cuda") * 0.5,
        "b": torch.randn(dim, device="cuda"),
    }
    bf16 = {n: x.bfloat16() for n, x in base.items()}
    fast_in, ref_in = leaves(bf16), leaves(bf16)
    fast = causal_conv1d(fast_in["x"], fast_in["w"], fast_in["b"], "silu", seq_lens=lens, backend="mamba_ssm")
    positions = position_ids_from_seq_lens(lens).cuda()
    ref = causal_conv1d_torch(ref_in["x"].float(), ref_in["w"].float(), ref_in["b"].float(), "silu", positions)
    compare("conv resets (causal-conv1d)", [fast], [ref], fast_in, ref_in)
