"""All-gather-KV attention: varlen attention with separate key boundaries (bottom-right causal alignment) against
dense attention, the strategy choice, and sharded vs unsharded parity on real gloo groups of 2 and 4 ranks, with
head counts Ulysses cannot split."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from cp_core import (
    ContextParallelError,
    CPTopology,
    build_packed_metadata,
    context_parallel_attention,
    kv_gather_attention,
    resolve_attention_cp_style,
    varlen_causal_attention,
)
from cp_core.kv_gather import balanced_stretches, key_range, query_stretch
from cp_core.packing import cu_seqlens_from_lens
from cp_core.testing import (
    GlooWorkers,
    attention_parity_failures,
    attention_style_difference,
    check_cp_parity,
    kv_attention_case,
    layout_cases,
    one_torch_thread,
    random_seq_lens,
)
from cp_core.varlen_attention import torch_varlen_attention

TOTAL = 64
HEAD_DIM = 8


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # The gloo workers share the 2 cores with this process; OpenMP spinning in here would starve them.
    with one_torch_thread():
        yield


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def dense_suffix_attention(q, k, v, q_lens, k_lens, scale=None, sliding_window=None):
    """float64 attention written out per document: query t of a document is key t + k_len - q_len."""
    group = q.size(1) // k.size(1)
    outputs, q_at, k_at = [], 0, 0
    for q_len, k_len in zip(q_lens, k_lens, strict=True):
        qd = q[q_at : q_at + q_len].double()
        kd = k[k_at : k_at + k_len].double().repeat_interleave(group, dim=1)
        vd = v[k_at : k_at + k_len].double().repeat_interleave(group, dim=1)
        position = torch.arange(q_len)[:, None] + (k_len - q_len)
        distance = position - torch.arange(k_len)[None, :]
        mask = distance >= 0
        if sliding_window is not None:
            mask &= distance < sliding_window
        scores = torch.einsum("ihd,jhd->hij", qd, kd) * (q.size(2) ** -0.5 if scale is None else scale)
        outputs.append(torch.einsum("hij,jhd->ihd", scores.masked_fill(~mask, float("-inf")).softmax(-1), vd))
        q_at, k_at = q_at + q_len, k_at + k_len
    return torch.cat(outputs)


@pytest.mark.parametrize(("q_heads", "kv_heads"), [(4, 4), (8, 2), (3, 1)])
@pytest.mark.parametrize("sliding_window", [None, 1, 3, 1000])
def test_separate_key_boundaries_match_dense(q_heads, kv_heads, sliding_window):
    rng = random.Random(q_heads * 10 + kv_heads)
    for trial in range(4):
        k_lens = [1, 7, 3, 12] if trial == 0 else random_seq_lens(40, rng, max_docs=6)
        # Each document's queries are a suffix of its keys: all of them, one, or anything between.
        q_lens = [k_len if trial == 1 else rng.randint(1, k_len) for k_len in k_lens]
        seed = 100 * trial + q_heads
        q = randn(sum(q_lens), q_heads, HEAD_DIM, seed=seed).requires_grad_()
        k = randn(sum(k_lens), kv_heads, HEAD_DIM, seed=seed + 1).requires_grad_()
        v = randn(sum(k_lens), kv_heads, HEAD_DIM + 2, seed=seed + 2).requires_grad_()
        out = varlen_causal_attention(
            q,
            k,
            v,
            cu_seqlens_from_lens(q_lens),
            max(q_lens),
            sliding_window=sliding_window,
            backend="torch",
            cu_seqlens_k=cu_seqlens_from_lens(k_lens),
            max_seqlen_k=max(k_lens),
        )
        want = dense_suffix_attention(q, k, v, q_lens, k_lens, sliding_window=sliding_window)
        grad_out = randn(*out.shape, seed=seed + 3)
        got_grads = torch.autograd.grad(out, (q, k, v), grad_out)
        want_grads = torch.autograd.grad(want, (q, k, v), grad_out.double())
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
        for got, expected in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(got.double(), expected.double(), rtol=1e-5, atol=1e-5)


def test_separate_key_boundaries_bad_input():
    q, k = torch.zeros(6, 2, HEAD_DIM), torch.zeros(9, 2, HEAD_DIM)
    cu_q, cu_k = cu_seqlens_from_lens([2, 4]), cu_seqlens_from_lens([5, 4])
    # Without separate key boundaries the token counts must agree, as before.
    with pytest.raises(ContextParallelError, match="tokens must agree"):
        varlen_causal_attention(q, k, k, cu_q, 4, backend="torch")
    with pytest.raises(ContextParallelError, match="pass both or neither"):
        varlen_causal_attention(q, k, k, cu_q, 4, backend="torch", cu_seqlens_k=cu_k)
    with pytest.raises(ContextParallelError, match=r"cu_seqlens_k \(4,\) must have one entry per entry"):
        varlen_causal_attention(
            q, k, k, cu_q, 4, backend="torch", cu_seqlens_k=cu_seqlens_from_lens([3, 3, 3]), max_seqlen_k=3
        )
    with pytest.raises(ContextParallelError, match="a document has 4 queries but 3 keys"):
        varlen_causal_attention(
            q, k, k, cu_q, 4, backend="torch", cu_seqlens_k=cu_seqlens_from_lens([6, 3]), max_seqlen_k=6
        )  # fmt: skip


@pytest.mark.parametrize(
    ("style", "q_heads", "kv_heads", "cp", "want"),
    [
        ("auto", 8, 2, 1, "ulysses"),
        ("auto", 8, 2, 8, "ulysses"),
        ("auto", 8, 2, 16, "kv_gather"),  # more ranks than query heads
        ("auto", 8, 2, 31, "kv_gather"),
        ("auto", 8, 2, 64, "kv_ring"),  # from AUTO_RING_FROM_CP the ring, whose memory does not grow with the row
        ("auto", 6, 6, 4, "kv_gather"),  # cp does not divide the query heads
        ("auto", 24, 6, 4, "kv_gather"),  # nor the KV heads, nor they it
        ("kv_gather", 8, 2, 2, "kv_gather"),
        ("kv_gather", 8, 2, 1, "kv_gather"),
        ("ulysses", 16, 8, 4, "ulysses"),
        (
            "ulysses",
            8,
            2,
            16,
            r"cp=16, q_heads=8.*use attention CP style 'kv_gather' or 'kv_ring' \(or 'auto'\), which take any cp",
        ),
        (
            "ring",
            8,
            2,
            2,
            r"unknown attention CP style 'ring'; choose one of \('auto', 'ulysses', 'kv_gather', 'kv_ring'\)",
        ),
        ("auto", 8, 3, 2, "q_heads=8 is not a multiple of kv_heads=3"),
    ],
)
def test_resolve_attention_cp_style(style, q_heads, kv_heads, cp, want):
    if want in ("ulysses", "kv_gather", "kv_ring"):
        assert resolve_attention_cp_style(style, q_heads, kv_heads, cp) == want
    else:
        with pytest.raises(ContextParallelError, match=want):
            resolve_attention_cp_style(style, q_heads, kv_heads, cp)


def test_key_range_reaches_back_to_the_first_documents_start():
    # Row of 32 over 4 ranks (8 each): documents [0, 5), [5, 27), [27, 32).
    seq_lens = [5, 22, 5]
    assert key_range(build_packed_metadata(seq_lens, 0, 4)) == (0, 8)
    assert key_range(build_packed_metadata(seq_lens, 1, 4)) == (5, 16)  # document 2 began on rank 0
    assert key_range(build_packed_metadata(seq_lens, 2, 4)) == (5, 24)  # ... and spans three ranks
    assert key_range(build_packed_metadata(seq_lens, 3, 4)) == (5, 32)
    assert key_range(build_packed_metadata(seq_lens, 3, 4), sliding_window=4) == (21, 32)  # the window's reach
    assert key_range(build_packed_metadata([8, 8, 8, 8], 2, 4)) == (16, 24)  # a cut on a boundary: nothing before


def test_query_stretch_pieces_and_keys_before():
    seq_lens = [5, 22, 5]  # documents [0, 5), [5, 27), [27, 32)
    meta = build_packed_metadata(seq_lens, 0, 4)
    assert query_stretch(meta, 0, 8) == query_stretch(meta, 0, 8, sliding_window=100)
    stretch = query_stretch(meta, 0, 8)
    assert (stretch.seq_lens, stretch.keys_before, stretch.key_start) == ((5, 3), 0, 0)
    stretch = query_stretch(meta, 12, 30)
    assert (stretch.seq_lens, stretch.keys_before, stretch.key_start) == ((15, 3), 7, 5)
    assert query_stretch(meta, 12, 30, sliding_window=4).keys_before == 3
    assert query_stretch(meta, 27, 32).keys_before == 0  # a cut on a boundary
    # The work: causal scores of each piece, counted one query at a time.
    for window in (None, 1, 4, 9):
        stretch = query_stretch(meta, 12, 30, sliding_window=window)
        per_query = [
            min(window or 10**9, before + j + 1)
            for n, before in zip(stretch.seq_lens, (stretch.keys_before, 0), strict=True)
            for j in range(n)
        ]
        assert stretch.causal_scores(window) == sum(per_query), window


def _work(stretches, window=None) -> float:
    return sum(s.causal_scores(window) for s in stretches)


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_balanced_stretches_even_out_one_spanning_document(cp):
    """One document over the row: rank r attends chunks 2r and 2cp-1-2r of 2cp (the middle rank of an odd cp keeps
    its shard), and every rank computes the same causal work (within a chunk's diagonal rounding)."""
    seq_len = 64 * cp
    plans = [balanced_stretches(build_packed_metadata([seq_len], r, cp)) for r in range(cp)]
    for rank, (stretches, partner) in enumerate(plans):
        if cp % 2 and rank == cp // 2:
            assert partner is None and [(s.start, s.end) for s in stretches] == [(rank * 64, rank * 64 + 64)]
            continue
        assert partner == cp - 1 - rank and plans[partner][1] == rank
        assert [(s.start, s.end) for s in stretches] == [
            (64 * rank, 64 * rank + 32),
            (seq_len - 32 * (2 * rank + 1), seq_len - 64 * rank),
        ]
    work = [_work(s) for s, _ in plans]
    unbalanced = [
        _work([query_stretch(build_packed_metadata([seq_len], r, cp), 64 * r, 64 * r + 64)]) for r in range(cp)
    ]
    assert max(work) < max(unbalanced)
    if cp % 2 == 0:
        assert max(work) == min(work), work


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
@pytest.mark.parametrize("window", [None, 5])
def test_balanced_stretches_cover_the_row_once_and_never_raise_the_busiest(cp, window):
    rng = random.Random(cp)
    layouts = [*layout_cases(16 * cp, cp).values()] + [random_seq_lens(16 * cp, rng) for _ in range(20)]
    for seq_lens in layouts:
        metas = [build_packed_metadata(seq_lens, r, cp) for r in range(cp)]
        plans = [balanced_stretches(m, window) for m in metas]
        covered = sorted((s.start, s.end) for stretches, _ in plans for s in stretches)
        assert [a for a, _ in covered] == [0, *[b for _, b in covered[:-1]]] and covered[-1][1] == 16 * cp
        for rank, (_, partner) in enumerate(plans):
            assert partner is None or plans[partner][1] == rank, (seq_lens, rank)  # a pair always agrees
        before = [_work([query_stretch(m, m.shard_start, m.shard_end, window)], window) for m in metas]
        after = [_work(stretches, window) for stretches, _ in plans]
        assert max(after) <= max(before), seq_lens
    # Documents no longer than a shard, one per shard: already even, so nobody swaps (no extra collectives).
    assert all(balanced_stretches(build_packed_metadata([16] * cp, r, cp))[1] is None for r in range(cp))


def test_without_cp_both_strategies_are_plain_varlen_attention():
    seq_lens = [5, 11, 3, 5]
    meta = build_packed_metadata(seq_lens)
    q, k, v = randn(24, 4, 8, seed=0), randn(24, 2, 8, seed=1), randn(24, 2, 8, seed=2)
    want = torch_varlen_attention(q, k, v, meta.cu_seqlens, sliding_window=3)
    for style in ("ulysses", "kv_gather"):
        got = context_parallel_attention(q, k, v, meta, CPTopology.single(), style, sliding_window=3, backend="torch")
        assert torch.equal(got, want), style
    with pytest.raises(
        ContextParallelError, match=r"must be one of \('ulysses', 'kv_gather', 'kv_ring'\) here, got 'auto'"
    ):
        context_parallel_attention(q, k, v, meta, CPTopology.single(), "auto")
    with pytest.raises(ContextParallelError, match="metadata was built for rank 1 of cp=2"):
        kv_gather_attention(q[:12], k[:12], v[:12], build_packed_metadata(seq_lens, 1, 2), CPTopology.single())
    with pytest.raises(ContextParallelError, match=r"local tokens=24.*got \(23, 4, 8\)"):
        kv_gather_attention(q[:23], k, v, meta, CPTopology.single())
    with pytest.raises(ContextParallelError, match="sliding_window must be >= 1 or None, got 0"):
        kv_gather_attention(q, k, v, meta, CPTopology.single(), sliding_window=0)


@pytest.mark.parametrize("rank", [0, 3])
def test_gather_kv_backward_holds_one_row_sized_gradient(rank):
    """Forward + backward of the gather on rank ``rank`` of a fake group of 4, bf16, MemTracker's peak of the bytes
    made inside: the gathered row and one zeroed row gradient (2 units of ``S 2 Hkv D``) plus the local shards'
    concatenation and reduce-scatter output (1/4 unit). Slicing a gathered tensor under autograd held 4 units (a
    zero-filled row-sized gradient per slice). One KV head's values get no gradient (its output unused)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from cp_core import gather_kv
    from cp_core.testing import fake_process_group

    seq_len, cp, heads, dim = 4096, 4, 2, 32
    unit = seq_len * 2 * heads * dim * 2
    with fake_process_group(rank, cp) as group:
        topology = CPTopology.from_group(group)
        start, end = key_range(build_packed_metadata([seq_len], rank, cp))
        k, v = (randn(seq_len // cp, heads, dim, seed=s).bfloat16().requires_grad_() for s in (0, 1))
        grads = [randn(end - start, 1, dim, seed=s).bfloat16() for s in range(2 * heads - 1)]
        tracker = MemTracker()
        with tracker:
            keys, values = gather_kv(k, v, topology, start, end)
            torch.autograd.backward([*keys, *values[:-1]], grads)
        peak = sum(device["Total"] for device in tracker.get_tracker_snapshot("peak").values())
    assert len(keys) == len(values) == heads
    assert all(t.shape == (end - start, 1, dim) for t in keys + values)
    assert k.grad.shape == v.grad.shape == k.shape
    assert peak <= 2.3 * unit, peak / unit


# --------------------------------------------------------------------------------------------------------
# Worker-side helpers (module level: the workers import them by name)


# --------------------------------------------------------------------------------------------------------
# Multi-process


@pytest.fixture(scope="module")
def workers(request):
    with GlooWorkers(request.param) as pool:
        yield pool


with_workers = pytest.mark.parametrize("workers", (2, 4), indirect=True, ids=lambda cp: f"cp{cp}")


def _parity_configs(cp: int) -> dict[str, dict]:
    return {
        "q1_kv1": {"q_heads": 1, "kv_heads": 1},  # fewer query heads than ranks: Ulysses cannot run
        "q3_kv1": {"q_heads": 3, "kv_heads": 1},  # cp does not divide the query heads
        "q8_kv2": {"q_heads": 8, "kv_heads": 2},  # Ulysses could: the strategies agree below
        "q6_kv3_window5": {"q_heads": 6, "kv_heads": 3, "sliding_window": 5},
        "window2": {"q_heads": 2, "kv_heads": 1, "sliding_window": 2},  # (W = 1: the true q, k grads are 0)
        "window_past_cut": {"q_heads": 2, "kv_heads": 2, "sliding_window": TOTAL // cp + 3},
        "scale": {"q_heads": 4, "kv_heads": 4, "scale": 0.37},
        "v_dim": {"q_heads": 4, "kv_heads": 1, "v_dim": HEAD_DIM + 4},  # separate gathers for k and v
        "v_dim_window": {"q_heads": 2, "kv_heads": 1, "v_dim": HEAD_DIM - 2, "sliding_window": 7},
        "unbalanced": {"q_heads": 4, "kv_heads": 2, "balance": False},  # every rank keeps its own queries
        "strided_q": {"q_heads": 4, "kv_heads": 2, "strided": True},
    }


@with_workers
@pytest.mark.parametrize("config_name", list(_parity_configs(2)))
def test_kv_gather_parity_over_layout_cases(workers, config_name):
    cp = workers.world_size
    config = _parity_configs(cp)[config_name]
    q_heads, kv_heads = config["q_heads"], config["kv_heads"]
    window = config.get("sliding_window")
    balance = config.get("balance", True)
    case = functools.partial(
        kv_attention_case, scale=config.get("scale"), sliding_window=window, balance=balance,
        strided=config.get("strided", False),
    )  # fmt: skip
    layouts = dict(layout_cases(TOTAL, cp))
    rng = random.Random(cp * 1000 + q_heads)
    for trial in range(2):
        layouts[f"random{trial}"] = random_seq_lens(TOTAL, rng)
    swaps = sum(
        balanced_stretches(build_packed_metadata(lens, r, cp), window)[1] is not None
        for lens in layouts.values()
        for r in range(cp)
    )
    if balance:
        assert swaps > 0  # the layouts exercise the query swap
    failures = attention_parity_failures(
        workers, case, layouts, q_heads=q_heads, kv_heads=kv_heads, head_dim=HEAD_DIM, v_dim=config.get("v_dim")
    )
    assert not failures, f"cp={cp} {config_name}:\n" + "\n".join(failures)


@with_workers
def test_kv_gather_agrees_with_ulysses(workers):
    cp = workers.world_size
    for index, seq_lens in enumerate(layout_cases(TOTAL, cp).values()):
        q, k, v = randn(TOTAL, 8, HEAD_DIM, seed=index), randn(TOTAL, 2, HEAD_DIM, seed=index + 1), None
        v = randn(TOTAL, 2, HEAD_DIM, seed=index + 2)
        for difference in workers.run(attention_style_difference, seq_lens, q, k, v, ("kv_gather", "ulysses")):
            assert difference < 1e-5, (seq_lens, difference)


@pytest.mark.parametrize("workers", (3,), indirect=True, ids=lambda cp: f"cp{cp}")
def test_kv_gather_parity_odd_cp_and_odd_shards(workers):
    """cp 3 (the middle rank keeps its queries while ranks 0 and 2 swap) with 7 tokens per rank (halves of 3 and 4
    tokens) and 1 token per rank (nothing to swap): exact against the unsharded run, with and without a window."""
    cp = workers.world_size
    for local in (7, 1):
        total = cp * local
        layouts = {"one_document": [total], "first_token_alone": [1, total - 1]}
        if local > 1:
            layouts["random"] = random_seq_lens(total, random.Random(local))
            plans = [balanced_stretches(build_packed_metadata([total], r, cp))[1] for r in range(cp)]
            assert plans == [2, None, 0]
        for window in (None, 2):
            for index, seq_lens in enumerate(layouts.values()):
                seed = 10 * index + local
                inputs = {
                    "q": randn(total, 2, HEAD_DIM, seed=seed),
                    "k": randn(total, 1, HEAD_DIM, seed=seed + 1),
                    "v": randn(total, 1, HEAD_DIM, seed=seed + 2),
                }
                case = functools.partial(kv_attention_case, sliding_window=window)
                report = check_cp_parity(
                    workers, case, seq_lens=seq_lens, inputs=inputs, seq_dims={"q": 0, "k": 0, "v": 0}, seed=seed
                )
                report.assert_close(rtol=1e-5)


def _frozen_keys_case(module, metadata, topology, q, k, v, *, ring: bool = False):
    """Only the queries train (keys and values frozen, e.g. LoRA on q_proj alone)."""
    return kv_attention_case(module, metadata, topology, q, k.detach(), v.detach(), ring=ring)


@pytest.mark.parametrize(
    ("workers", "seq_lens"), [(3, [15]), (4, [3, 14, 2, 1])], indirect=["workers"], ids=["cp3", "cp4"]
)
@pytest.mark.parametrize("ring", [False, True], ids=["gather", "ring"])
def test_frozen_keys_and_values_train_the_queries(workers, seq_lens, ring):
    """With frozen keys and values, ranks that swap query halves run the gather's backward for the swapped queries'
    gradient while the others run none: no rank may then wait in the keys' reduce-scatter (it hung before), and
    dq equals the unsharded run's."""
    cp = workers.world_size
    assert {balanced_stretches(build_packed_metadata(seq_lens, r, cp))[1] is None for r in range(cp)} == {True, False}
    total = sum(seq_lens)
    inputs = {"q": randn(total, 4, HEAD_DIM, seed=1), "k": randn(total, 2, HEAD_DIM, seed=2),
              "v": randn(total, 2, HEAD_DIM, seed=3)}  # fmt: skip
    case = functools.partial(_frozen_keys_case, ring=ring)
    report = check_cp_parity(workers, case, seq_lens=seq_lens, inputs=inputs, seq_dims={"q": 0, "k": 0, "v": 0})
    assert "grad.q" in report.relative and "grad.k" not in report.relative
    report.assert_close(rtol=1e-5)
