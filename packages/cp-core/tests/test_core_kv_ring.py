"""Ring attention: the block kernels against dense attention, the plan against the causal pairs it must cover,
sharded vs unsharded parity on real gloo groups of 2, 3 and 4 ranks, agreement with all-gather KV, and the
memory it keeps (rank-sized, where all-gather KV's grows with the row)."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from cp_core import (
    AUTO_RING_FROM_CP,
    ContextParallelError,
    CPTopology,
    build_packed_metadata,
    context_parallel_attention,
    kv_gather_attention,
    kv_ring_attention,
    resolve_attention_cp_style,
)
from cp_core.kv_gather import balanced_stretches, query_stretch
from cp_core.kv_ring import (
    REFERENCE_KERNELS,
    block_calls,
    reference_block_backward,
    reference_block_forward,
    resolve_ring_kernels,
    ring_plans,
)
from cp_core.packing import cu_seqlens_from_lens
from cp_core.testing import (
    GlooWorkers,
    attention_parity_failures,
    attention_style_difference,
    check_cp_parity,
    fake_process_group,
    kv_attention_case,
    layout_cases,
    one_torch_thread,
    random_seq_lens,
    saved_storages,
)
from cp_core.varlen_attention import torch_varlen_attention

TOTAL = 64
HEAD_DIM = 8


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


def randn(*shape: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# --------------------------------------------------------------------------------------------------------
# Block kernels


def _dense_block(q, k, v, q_lens, k_lens, causal, scale):
    """Per-document attention by autograd-able fp64 ops: (out [Tq, H, Dv], lse [H, Tq])."""
    group = q.size(1) // k.size(1)
    outs, lses, qa, ka = [], [], 0, 0
    for q_len, k_len in zip(q_lens, k_lens, strict=True):
        qd = q[qa : qa + q_len]
        kd, vd = (t[ka : ka + k_len].repeat_interleave(group, dim=1) for t in (k, v))
        scores = torch.einsum("ihd,jhd->hij", qd, kd) * scale
        if causal:  # equal lengths: a query sees its own position and earlier ones
            scores = scores.masked_fill(torch.ones(q_len, k_len, dtype=torch.bool).triu(1), float("-inf"))
        outs.append(torch.einsum("hij,jhd->ihd", scores.softmax(-1), vd))
        lses.append(scores.logsumexp(-1))
        qa, ka = qa + q_len, ka + k_len
    return torch.cat(outs), torch.cat(lses, dim=1)


@pytest.mark.parametrize(("q_heads", "kv_heads"), [(2, 2), (6, 2), (3, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_reference_block_kernels_match_dense_attention(q_heads, kv_heads, causal):
    """Forward: the output and the log-sum-exp. Backward from a *given* output and log-sum-exp (the row's, as the
    ring passes them): with this block's own, the gradients equal autograd's through the dense attention."""
    rng = random.Random(q_heads + causal)
    for trial in range(3):
        q_lens = random_seq_lens(30, rng, max_docs=4)
        k_lens = q_lens if causal else [rng.randint(1, 9) for _ in q_lens]
        seed = 10 * trial + q_heads
        q = randn(sum(q_lens), q_heads, HEAD_DIM, seed=seed, dtype=torch.float64).requires_grad_()
        k = randn(sum(k_lens), kv_heads, HEAD_DIM, seed=seed + 1, dtype=torch.float64).requires_grad_()
        v = randn(sum(k_lens), kv_heads, HEAD_DIM + 3, seed=seed + 2, dtype=torch.float64).requires_grad_()
        cu_q, cu_k = cu_seqlens_from_lens(q_lens), cu_seqlens_from_lens(k_lens)
        args = (cu_q, cu_k, max(q_lens), max(k_lens), causal, 0.3)
        out, lse = reference_block_forward(q, k, v, *args)
        want_out, want_lse = _dense_block(q, k, v, q_lens, k_lens, causal, 0.3)
        torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
        dout = randn(*out.shape, seed=seed + 3, dtype=torch.float64)
        got = reference_block_backward(dout, q, k, v, out.detach(), lse.detach(), *args)
        want = torch.autograd.grad(want_out, (q, k, v), dout)
        for name, g, w in zip("qkv", got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"d{n}: {m}")


def test_block_backward_splits_over_key_blocks():
    """The decomposition the ring rests on: attention over keys A + B, merged by log-sum-exp, equals attention over
    both; and the backward of each part, given the merged output and log-sum-exp, sums to the whole's."""
    q = randn(7, 4, HEAD_DIM, seed=0, dtype=torch.float64)
    k, v = randn(12, 2, HEAD_DIM, seed=1, dtype=torch.float64), randn(12, 2, HEAD_DIM, seed=2, dtype=torch.float64)
    dout = randn(7, 4, HEAD_DIM, seed=3, dtype=torch.float64)
    cu_q = cu_seqlens_from_lens([7])
    whole = reference_block_forward(q, k, v, cu_q, cu_seqlens_from_lens([12]), 7, 12, False, 0.5)
    parts = [
        reference_block_forward(q, k[a:b], v[a:b], cu_q, cu_seqlens_from_lens([b - a]), 7, b - a, False, 0.5)
        for a, b in ((0, 5), (5, 12))
    ]
    lse = torch.logaddexp(parts[0][1], parts[1][1])
    out = sum(o * (part_lse - lse).exp().T[..., None] for o, part_lse in parts)
    torch.testing.assert_close(out, whole[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, whole[1], rtol=1e-12, atol=1e-12)
    want = reference_block_backward(dout, q, k, v, *whole, cu_q, cu_seqlens_from_lens([12]), 7, 12, False, 0.5)
    pieces = [
        reference_block_backward(
            dout, q, k[a:b], v[a:b], out, lse, cu_q, cu_seqlens_from_lens([b - a]), 7, b - a, False, 0.5
        )
        for a, b in ((0, 5), (5, 12))
    ]
    torch.testing.assert_close(pieces[0][0] + pieces[1][0], want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([pieces[0][1], pieces[1][1]]), want[1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([pieces[0][2], pieces[1][2]]), want[2], rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------------------------------------
# The plan


def _pairs_of(stretches, calls_by_step, rank, cp, local) -> list[tuple[int, int]]:
    """Every (query position, key position) pair the plan's calls compute, in global positions."""
    starts, row = [], 0
    for s in stretches:
        starts.append((row, s.start))
        row += s.end - s.start

    def position(r: int) -> int:
        base_row, base = max(p for p in starts if p[0] <= r)
        return base + r - base_row

    pairs = []
    for step, calls in enumerate(calls_by_step):
        block_start = ((rank - step) % cp) * local
        for call in calls:
            rows, keys = call.rows[0], call.keys[0]
            for q_len, k_len in zip(call.q_lens, call.k_lens, strict=True):
                for i in range(q_len):
                    for j in range(k_len):
                        if call.causal and j > i:
                            continue
                        pairs.append((position(rows + i), block_start + keys + j))
                rows, keys = rows + q_len, keys + k_len
    return pairs


def _causal_pairs(seq_lens, stretches) -> list[tuple[int, int]]:
    doc_of, start_of, at = [], [], 0
    for n in seq_lens:
        doc_of += [len(start_of)] * n
        start_of.append(at)
        at += n
    return [(t, j) for s in stretches for t in range(s.start, s.end) for j in range(start_of[doc_of[t]], t + 1)]


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
@pytest.mark.parametrize("balance", [True, False])
def test_ring_plan_computes_every_causal_pair_once(cp, balance):
    rng = random.Random(cp * 10 + balance)
    total = 8 * cp
    layouts = [*layout_cases(total, cp, seed=cp).values()] + [random_seq_lens(total, rng) for _ in range(15)]
    for seq_lens in layouts:
        plans = ring_plans(tuple(seq_lens), cp, balance)
        assert len({p.hops for p in plans}) == 1  # one hop count, or the ring would hang
        for rank, plan in enumerate(plans):
            assert len(plan.calls) == plan.hops + 1
            got = _pairs_of(plan.stretches, plan.calls, rank, cp, total // cp)
            want = _causal_pairs(seq_lens, plan.stretches)
            assert sorted(got) == sorted(want), (seq_lens, rank)
            assert len(got) == len(set(got)), (seq_lens, rank)
        meta = build_packed_metadata(seq_lens, 0, cp)
        own = [(query_stretch(meta, r * total // cp, (r + 1) * total // cp),) for r in range(cp)]
        if balance:  # all-gathered KV's swap where it keeps the ring as short as without swaps, else none
            unbalanced = ring_plans(tuple(seq_lens), cp, False)[0].hops
            assert plans[0].hops <= unbalanced
            for rank, plan in enumerate(plans):
                gather_choice = balanced_stretches(meta, rank=rank)
                assert (plan.stretches, plan.partner) in (
                    (tuple(gather_choice[0]), gather_choice[1]),
                    (own[rank], None),
                )
                assert plan.partner is None or plans[plan.partner].partner == rank
        else:
            assert [p.stretches for p in plans] == own and {p.partner for p in plans} == {None}


def test_ring_makes_only_the_hops_some_rank_needs():
    cp, local = 4, 8
    assert ring_plans((32,), cp)[0].hops == cp - 1  # one document over the row
    assert ring_plans((8, 8, 8, 8), cp)[0].hops == 0  # every cut on a shard boundary: no traffic at all
    assert ring_plans((4, 8, 8, 8, 4), cp)[0].hops == 1  # documents straddle one cut each
    assert ring_plans((4, 16, 12), cp, balance=False)[0].hops == 2  # document 2 spans ranks 0 .. 2
    # Two documents of two shards: each rank needs the block before its own. Swapping would even the work (rank
    # 1 attending half of rank 2's queries), but rank 1 would then wait for block 2, which comes round last: the
    # ring keeps its one hop and nobody swaps.
    for balance in (False, True):
        plans = ring_plans((2 * local, 2 * local), cp, balance)
        assert plans[0].hops == 1 and {p.partner for p in plans} == {None}
    assert balanced_stretches(build_packed_metadata([2 * local, 2 * local], 0, cp), rank=1)[1] == 2  # under kv_gather
    plan = ring_plans((32,), cp)[0]
    assert plan.partner == 3 and [(s.start, s.end) for s in plan.stretches] == [(0, 4), (28, 32)]


def test_last_step_is_the_latest_arrival_of_a_block_range():
    from cp_core.kv_ring_plan import _last_step

    for cp in range(1, 9):
        for rank in range(cp):
            for first in range(cp):
                for last in range(first, cp):
                    want = max((rank - block) % cp for block in range(first, last + 1))
                    assert _last_step(rank, cp, first, last) == want, (cp, rank, first, last)


def test_block_calls_of_a_stretch_against_blocks():
    meta = build_packed_metadata([5, 22, 5], 0, 4)  # documents [0, 5), [5, 27), [27, 32); shards of 8
    stretch = query_stretch(meta, 20, 24)  # inside block 2, its document began at 5
    assert block_calls([stretch], 24, 32) == []  # keys after the stretch
    (before,) = block_calls([stretch], 8, 16)  # all of block 1
    assert (before.rows, before.keys, before.q_lens, before.k_lens, before.causal) == (
        (0, 4),
        (0, 8),
        (4,),
        (8,),
        False,
    )
    calls = block_calls([stretch], 16, 24)  # its own block: keys 16..19 before it, then the diagonal
    assert [(c.rows, c.keys, c.causal) for c in calls] == [((0, 4), (0, 4), False), ((0, 4), (4, 8), True)]
    (first,) = block_calls([stretch], 0, 8)
    assert (first.keys, first.k_lens) == ((5, 8), (3,))  # from the document's start


# --------------------------------------------------------------------------------------------------------
# Single process


def test_without_cp_ring_is_plain_varlen_attention():
    seq_lens = [5, 11, 3, 5]
    meta = build_packed_metadata(seq_lens)
    q, k, v = randn(24, 4, 8, seed=0), randn(24, 2, 8, seed=1), randn(24, 2, 8, seed=2)
    want = torch_varlen_attention(q, k, v, meta.cu_seqlens)
    got = context_parallel_attention(q, k, v, meta, CPTopology.single(), "kv_ring", backend="torch")
    assert torch.equal(got, want)
    want = torch_varlen_attention(q, k, v, meta.cu_seqlens, sliding_window=3)
    assert torch.equal(kv_ring_attention(q, k, v, meta, CPTopology.single(), sliding_window=3), want)  # no CP
    with pytest.raises(ContextParallelError, match="metadata was built for rank 1 of cp=2"):
        kv_ring_attention(q[:12], k[:12], v[:12], build_packed_metadata(seq_lens, 1, 2), CPTopology.single())
    with pytest.raises(ContextParallelError, match="sliding_window must be >= 1 or None, got 0"):
        kv_ring_attention(q, k, v, meta, CPTopology.single(), sliding_window=0)
    window = r"ring attention takes no sliding window \(got sliding_window=3"
    with fake_process_group(1, 2) as group, pytest.raises(ContextParallelError, match=window):  # before any exchange
        meta_1 = build_packed_metadata(seq_lens, 1, 2)
        kv_ring_attention(q[12:], k[12:], v[12:], meta_1, CPTopology.from_group(group), sliding_window=3)


def test_ring_kernels_by_backend():
    q, v = torch.zeros(4, 2, 8), torch.zeros(4, 1, 8)
    assert resolve_ring_kernels("auto", q, v) is REFERENCE_KERNELS  # CPU
    assert resolve_ring_kernels("torch", q.bfloat16(), v.bfloat16()) is REFERENCE_KERNELS
    with pytest.raises(ContextParallelError, match="'varlen' needs CUDA fp16/bf16 tensors"):
        resolve_ring_kernels("varlen", q, v)


@pytest.mark.parametrize(
    ("style", "cp", "want"),
    [
        ("kv_ring", 64, "kv_ring"),
        ("kv_ring", 1, "kv_ring"),
        ("auto", 16, "kv_gather"),  # past Ulysses' head rule: all-gathered KV, the ring from AUTO_RING_FROM_CP
        ("auto", 31, "kv_gather"),
        ("auto", 32, "kv_ring"),
        ("auto", 64, "kv_ring"),
        ("ulysses", 16, r"use attention CP style 'kv_gather' or 'kv_ring' \(or 'auto'\), which take any cp"),
        ("ring", 2, r"unknown attention CP style 'ring'; choose one of .*'kv_ring'"),
    ],
)
def test_resolve_ring_style(style, cp, want):
    if want in ("kv_ring", "kv_gather"):
        assert resolve_attention_cp_style(style, 8, 2, cp) == want
    else:
        with pytest.raises(ContextParallelError, match=want):
            resolve_attention_cp_style(style, 8, 2, cp)


def test_auto_keeps_ulysses_wherever_its_head_rule_holds():
    assert AUTO_RING_FROM_CP == 32
    assert resolve_attention_cp_style("auto", 64, 8, 64) == "ulysses"  # even work per rank, whatever the cp
    assert resolve_attention_cp_style("auto", 32, 2, 32) == "ulysses"  # KV replicated to the ranks
    assert resolve_attention_cp_style("auto", 32, 2, 64) == "kv_ring"


def _ring_and_gather_memory(rank: int, cp: int, local: int, heads: int, dim: int) -> dict[str, tuple[int, int]]:
    """Per strategy, on rank ``rank`` of a fake group: the largest storage autograd keeps for backward, and
    MemTracker's peak over forward + backward, bytes."""
    from torch.distributed._tools.mem_tracker import MemTracker

    results = {}
    meta = build_packed_metadata([cp * local], rank, cp)
    with fake_process_group(rank, cp) as group:
        topology = CPTopology.from_group(group)
        for name, attend in (("ring", kv_ring_attention), ("gather", kv_gather_attention)):
            q = randn(local, 2 * heads, dim, seed=0).bfloat16().requires_grad_()
            k, v = (randn(local, heads, dim, seed=s).bfloat16().requires_grad_() for s in (1, 2))
            tracker = MemTracker()
            with tracker:
                out, storages = saved_storages(lambda: attend(q, k, v, meta, topology, backend="torch"))  # noqa: B023
                out.backward(torch.ones_like(out))
            peak = sum(device["Total"] for device in tracker.get_tracker_snapshot("peak").values())
            results[name] = (max(storages.values()), peak)
    return results


def test_ring_keeps_rank_sized_tensors_where_gather_keeps_the_row():
    """bf16, one document over the row, the last rank (it reads every key), 64 tokens a rank, 1 KV head: the
    largest tensor the ring keeps for backward is rank-sized at cp 4 and 16 alike, where all-gather KV keeps the
    gathered row (cp times the rank's keys and values); the ring's peak grows by less than a third from cp 4 to
    16 (its plan's bounds and the partner's queries), all-gather KV's more than doubles."""
    local, heads, dim = 64, 1, 64
    rank_kv = local * 2 * heads * dim * 2
    small, large = (_ring_and_gather_memory(cp - 1, cp, local, heads, dim) for cp in (4, 16))
    for cp, result in ((4, small), (16, large)):
        assert result["ring"][0] <= local * 2 * heads * dim * 4 * 2, result  # the fp32 lse/out of the shard at most
        assert result["gather"][0] >= cp * rank_kv, result
    assert large["ring"][1] < 1.35 * small["ring"][1], (small, large)
    assert large["gather"][1] > 2 * small["gather"][1], (small, large)


# --------------------------------------------------------------------------------------------------------
# Multi-process


_ring_case = functools.partial(kv_attention_case, ring=True)


@pytest.fixture(scope="module")
def workers(request):
    with GlooWorkers(request.param) as pool:
        yield pool


with_workers = pytest.mark.parametrize("workers", (2, 4), indirect=True, ids=lambda cp: f"cp{cp}")

PARITY_CONFIGS = {
    "q1_kv1": {"q_heads": 1, "kv_heads": 1},
    "q8_kv2": {"q_heads": 8, "kv_heads": 2},
    "q3_kv1_scale": {"q_heads": 3, "kv_heads": 1, "scale": 0.37},
    "v_dim": {"q_heads": 4, "kv_heads": 1, "v_dim": HEAD_DIM + 4},
    "unbalanced": {"q_heads": 4, "kv_heads": 2, "balance": False},
    "strided_q": {"q_heads": 4, "kv_heads": 2, "strided": True},
}


@with_workers
@pytest.mark.parametrize("config_name", list(PARITY_CONFIGS))
def test_kv_ring_parity_over_layout_cases(workers, config_name):
    cp = workers.world_size
    config = PARITY_CONFIGS[config_name]
    q_heads, kv_heads = config["q_heads"], config["kv_heads"]
    case = functools.partial(
        _ring_case, scale=config.get("scale"), sliding_window=config.get("sliding_window"),
        balance=config.get("balance", True), strided=config.get("strided", False),
    )  # fmt: skip
    layouts = dict(layout_cases(TOTAL, cp, seed=len(config_name)))
    local = TOTAL // cp
    layouts["one_per_shard"] = [local] * cp  # no hops at all
    layouts["straddling_each_cut"] = [local // 2, *[local] * (cp - 1), local // 2]  # one hop
    rng = random.Random(cp * 1000 + q_heads)
    for trial in range(2):
        layouts[f"random{trial}"] = random_seq_lens(TOTAL, rng)
    hops = {ring_plans(tuple(lens), cp, config.get("balance", True))[0].hops for lens in layouts.values()}
    assert cp - 1 in hops and min(hops) < cp - 1, hops  # full rings and shorter ones
    failures = attention_parity_failures(
        workers, case, layouts, q_heads=q_heads, kv_heads=kv_heads, head_dim=HEAD_DIM, v_dim=config.get("v_dim")
    )
    assert not failures, f"cp={cp} {config_name}:\n" + "\n".join(failures)


def _assert_float64_parity(workers, seq_lens, seed: int) -> dict[str, torch.Tensor]:
    """The ring against the unsharded run in fp64 (4 query, 2 KV heads), to 1e-12; returns the inputs."""
    total = sum(seq_lens)
    inputs = {
        name: randn(total, heads, HEAD_DIM, seed=seed + offset, dtype=torch.float64)
        for offset, (name, heads) in enumerate((("q", 4), ("k", 2), ("v", 2)))
    }
    report = check_cp_parity(
        workers, _ring_case, seq_lens=seq_lens, inputs=inputs, seq_dims={"q": 0, "k": 0, "v": 0}, seed=seed
    )
    report.assert_close(rtol=1e-12)
    return inputs


@with_workers
def test_kv_ring_float64_is_exact_and_agrees_with_gather(workers):
    """fp64 parity to 1e-12 (a plan or merge bug is not hidden in fp32 rounding), and the ring's output equals
    all-gather KV's on every rank."""
    cp = workers.world_size
    for index, seq_lens in enumerate(layout_cases(TOTAL, cp, seed=7).values()):
        inputs = _assert_float64_parity(workers, seq_lens, index)
        qkv = (inputs[n].float() for n in "qkv")
        for difference in workers.run(attention_style_difference, seq_lens, *qkv, ("kv_ring", "kv_gather")):
            assert difference < 1e-5, (seq_lens, difference)


@with_workers
def test_kv_ring_bfloat16_within_rounding(workers):
    """bf16 inputs: the output is rounded once from fp32 merging, the key and value gradients travel in bf16 and
    are rounded at each hop (as a ring reduce-scatter's are); within 2 % of the scale of the unsharded bf16 run."""
    cp = workers.world_size
    layouts = layout_cases(TOTAL, cp, seed=3)
    for index, name in enumerate(("single_document", "spans_all_ranks", "mixed_random")):
        inputs = {
            "q": randn(TOTAL, 4, HEAD_DIM, seed=index).bfloat16(),
            "k": randn(TOTAL, 2, HEAD_DIM, seed=index + 1).bfloat16(),
            "v": randn(TOTAL, 2, HEAD_DIM, seed=index + 2).bfloat16(),
        }
        report = check_cp_parity(
            workers, _ring_case, seq_lens=layouts[name], inputs=inputs, seq_dims={"q": 0, "k": 0, "v": 0}, seed=index
        )
        report.assert_close(rtol=2e-2)


@pytest.mark.parametrize("workers", (8,), indirect=True, ids=lambda cp: f"cp{cp}")
def test_kv_ring_parity_cp8_float64(workers):
    """cp 8 (up to 7 hops, four swapping pairs, a ring shortened by the swap rule), fp64 to 1e-12: one document over
    the row, documents straddling cuts, and random cuts with odd-sized shards."""
    cp, local = workers.world_size, 5
    total = cp * local
    rng = random.Random(8)
    layouts = {
        "one_document": [total],
        "straddling": [3, *[local] * (cp - 1), local - 3],
        "random": random_seq_lens(total, rng),
        "tiny_and_long": [1, 2, total - 3],
    }
    hops = {ring_plans(tuple(lens), cp)[0].hops for lens in layouts.values()}
    assert cp - 1 in hops and 1 in hops, hops
    for index, seq_lens in enumerate(layouts.values()):
        _assert_float64_parity(workers, seq_lens, index)


@pytest.mark.parametrize("workers", (3,), indirect=True, ids=lambda cp: f"cp{cp}")
def test_kv_ring_parity_odd_cp_and_odd_shards(workers):
    """cp 3 (the middle rank keeps its queries; ranks 0 and 2 swap halves of 3 and 4 tokens) and 1 token a rank."""
    cp = workers.world_size
    for local in (7, 1):
        total = cp * local
        layouts = {"one_document": [total], "first_token_alone": [1, total - 1]}
        if local > 1:
            layouts["random"] = random_seq_lens(total, random.Random(local))
        for index, seq_lens in enumerate(layouts.values()):
            seed = 10 * index + local
            inputs = {
                "q": randn(total, 2, HEAD_DIM, seed=seed),
                "k": randn(total, 1, HEAD_DIM, seed=seed + 1),
                "v": randn(total, 1, HEAD_DIM, seed=seed + 2),
            }
            report = check_cp_parity(
                workers, _ring_case, seq_lens=seq_lens, inputs=inputs, seq_dims={"q": 0, "k": 0, "v": 0}, seed=seed
            )
            report.assert_close(rtol=1e-5)
