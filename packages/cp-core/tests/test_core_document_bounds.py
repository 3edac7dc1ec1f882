"""The row's kernel boundaries (cp_core.document_bounds): their contents equal what the kernels were given per call
(cu_seqlens, fla's chunk indices, mamba-ssm's seq_idx), and the metadata builds them once and shares them."""

from __future__ import annotations

import importlib

import pytest
import torch

from cp_core import build_packed_metadata, cu_seqlens_from_lens
from cp_core.chunking import build_chunk_layout
from cp_core.document_bounds import FLA_CHUNK, build_document_bounds, build_row_bounds, chunk_indices_from_lens
from cp_core.gated_delta import chunk_gated_delta_rule_torch

CASES = [[1], [64], [65], [37, 64, 90, 1], [128, 3, 200, 64, 5]]


def _chunks_of_layout(lens) -> torch.Tensor:
    """[chunks, 2] (document, chunk inside it) read off the torch reference's chunk layout."""
    layout = build_chunk_layout(lens, FLA_CHUNK)
    firsts = {}
    rows = []
    for c, doc in enumerate(layout.chunk_doc):
        firsts.setdefault(doc, c)
        rows.append([doc, c - firsts[doc]])
    return torch.tensor(rows, dtype=torch.int64)


@pytest.mark.parametrize("lens", CASES)
def test_bounds_hold_what_the_kernels_were_given_per_call(lens):
    bounds = build_document_bounds(lens, "cpu")
    old_cu = cu_seqlens_from_lens(lens)  # cu_seqlens as built from the lengths alone
    assert bounds.seq_lens == tuple(lens) and bounds.max_seqlen == max(lens) and bounds.num_tokens == sum(lens)
    assert bounds.cu_seqlens.dtype == torch.int64 and torch.equal(bounds.cu_seqlens, old_cu.long())
    assert bounds.cu_seqlens_cpu.device.type == "cpu" and torch.equal(bounds.cu_seqlens_cpu, old_cu.long())
    assert bounds.cu_seqlens_int32.dtype == torch.int32 and torch.equal(bounds.cu_seqlens_int32, old_cu)
    assert bounds.chunk_indices.dtype == torch.int64
    assert torch.equal(bounds.chunk_indices, _chunks_of_layout(lens))
    old_seq_idx = torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32), torch.tensor(lens))[None]
    assert bounds.seq_idx.dtype == torch.int32 and torch.equal(bounds.seq_idx, old_seq_idx)
    assert bounds.seq_idx is bounds.seq_idx  # built once
    kwargs = bounds.fla_kwargs()
    assert kwargs.keys() == {"cu_seqlens", "cu_seqlens_cpu", "chunk_indices"}
    assert kwargs["chunk_indices"] is bounds.chunk_indices and kwargs["cu_seqlens"] is bounds.cu_seqlens
    assert bounds.fla_kwargs(chunk_indices=False).keys() == {"cu_seqlens", "cu_seqlens_cpu"}


def test_chunk_indices_by_hand():
    expected = [[0, 0], [1, 0], [2, 0], [2, 1], [2, 2], [3, 0]]
    assert chunk_indices_from_lens([64, 1, 130, 7]).tolist() == expected
    assert chunk_indices_from_lens([10, 40], chunk_size=16).tolist() == [[0, 0], [1, 0], [1, 1], [1, 2]]


def test_fla_arguments_and_document_index():
    lens = [5, 64, 3]
    bounds = build_document_bounds(lens, torch.device("cpu"))
    kwargs = bounds.fla_kwargs(chunk_indices=False)
    assert kwargs.keys() == {"cu_seqlens", "cu_seqlens_cpu"}
    assert torch.equal(kwargs["cu_seqlens"], torch.tensor([0, 5, 69, 72])) and kwargs["cu_seqlens"].dtype == torch.int64
    assert torch.equal(kwargs["cu_seqlens_cpu"], kwargs["cu_seqlens"])
    assert bounds.seq_idx.tolist() == [[0] * 5 + [1] * 64 + [2] * 3]


def test_metadata_builds_the_row_bounds_once_and_shares_them():
    host = build_packed_metadata([30, 50, 20, 28], cp_rank=1, cp_size=2)  # shard [64, 128): docs clipped 16, 20, 28
    moved = host.to("cpu")
    row = moved.bounds
    assert row.local.seq_lens == host.local_seq_lens == (16, 20, 28) and row.row.seq_lens == host.seq_lens
    assert moved.cu_seqlens is row.row.cu_seqlens_int32 and moved.local_cu_seqlens is row.local.cu_seqlens_int32
    assert torch.equal(moved.cu_seqlens, host.cu_seqlens) and torch.equal(moved.local_cu_seqlens, host.local_cu_seqlens)
    assert moved.kernel_bounds("cpu") is row and moved.kernel_bounds(torch.device("cpu")) is row
    built = host.kernel_bounds("cpu")  # host metadata: built on the fly, the same contents
    assert built is not host.kernel_bounds("cpu") and built.local.seq_lens == row.local.seq_lens
    assert torch.equal(built.row.chunk_indices, row.row.chunk_indices)

    single = build_packed_metadata([30, 50], 0, 1).to("cpu").bounds
    assert single.local is single.row  # without CP one set of bounds serves both

    segment = row.for_lens((16384,))
    assert row.for_lens([16384]) is segment and segment.seq_lens == (16384,)
    assert row.for_lens(host.local_seq_lens) is row.local and row.for_lens(host.seq_lens) is row.row
    table = row.int32_table((0, 3, 9))
    assert row.int32_table([0, 3, 9]) is table and table.dtype == torch.int32 and table.tolist() == [0, 3, 9]


def test_row_bounds_on_the_meta_device():
    row = build_row_bounds((4, 4), (4, 4, 8), "meta")
    assert row.device.type == "meta" and row.local.cu_seqlens.device.type == "meta"
    assert row.local.cu_seqlens_cpu.tolist() == [0, 4, 8] and row.row.max_seqlen == 8


def test_prepass_segments_take_their_bounds_from_the_row(monkeypatch):
    """The GDN pre-pass (CP) runs checkpointed segments; with a row's bounds each segment length's bounds are built
    once, recomputation in backward included, and the result is the torch run's (the fla call is faked on CPU)."""
    gated_delta = importlib.import_module("cp_core.gated_delta")
    handed = []

    def fake_fla(q, k, v, g, beta, *, bounds, scale, initial_state, qk_l2norm):
        handed.append(bounds)
        return chunk_gated_delta_rule_torch(
            q, k, v, g, beta, seq_lens=bounds.seq_lens, scale=scale, initial_state=initial_state, qk_l2norm=qk_l2norm
        )

    gen = torch.Generator().manual_seed(0)
    tokens, heads, dim = 150, 2, 8
    q, k, v = (torch.randn(tokens, heads, dim, generator=gen, dtype=torch.float64) * 0.3 for _ in range(3))
    g = -torch.rand(tokens, heads, generator=gen, dtype=torch.float64) * 0.1
    beta = torch.rand(tokens, heads, generator=gen, dtype=torch.float64)
    inputs = [t.requires_grad_() for t in (q, k, v, g, beta)]

    def run(**kwargs):
        state = gated_delta.prepass_summary(*inputs, with_transition=True, segment_tokens=64, **kwargs)
        return state, torch.autograd.grad(state.square().sum(), inputs[1:])  # q does not reach the state

    reference, reference_grads = run(backend="torch")
    monkeypatch.setattr(gated_delta, "resolve_recurrent_backend", lambda *args: "fla")
    monkeypatch.setattr(gated_delta, "_chunk_gated_delta_rule_fla", fake_fla)
    row = build_row_bounds((tokens,), (tokens, 50), "cpu")
    state, grads = run(backend="fla", bounds_for=row.for_lens)

    # Forward, then the checkpoint's recompute (last segment first): one bounds object per segment length.
    assert [b.seq_lens for b in handed] == [(64,), (64,), (22,), (22,), (64,), (64,)]
    assert len({id(b) for b in handed}) == 2 and row.for_lens((64,)) is handed[0] and row.for_lens([22]) is handed[2]
    assert torch.equal(state, reference)
    for a, b in zip(grads, reference_grads, strict=True):
        assert torch.equal(a, b)


def test_rebuilt_forward_arguments_still_share_what_the_row_built():
    """FSDP's mixed-precision input casting rebuilds every dataclass among a block's forward arguments field by
    field: the copies of the metadata must keep sharing the row's tensors and what later layers build."""
    from torch.distributed.utils import _apply_to_tensors

    meta = build_packed_metadata([30, 50, 20, 28], cp_rank=1, cp_size=2).to("cpu")
    copy = _apply_to_tensors(lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t, meta)
    assert copy is not meta and copy.bounds is not meta.bounds
    assert copy.bounds.local.cu_seqlens is meta.bounds.local.cu_seqlens
    assert copy.bounds.local.chunk_indices is meta.bounds.local.chunk_indices
    assert copy.bounds.local.seq_idx is meta.bounds.local.seq_idx  # built by the copy, kept for the original too
    assert copy.bounds.for_lens((64,)) is meta.bounds.for_lens((64,))
    assert copy.bounds.int32_table((0, 5)) is meta.bounds.int32_table((0, 5))
