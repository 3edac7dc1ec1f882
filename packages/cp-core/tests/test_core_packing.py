"""Packed-row metadata against a per-token brute force, its validation, and the layout generator."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from cp_core import (
    ContextParallelError,
    PackedRowMetadata,
    build_packed_metadata,
    check_divisible,
    cu_seqlens_from_lens,
    normalize_seq_lens,
    position_ids_from_seq_lens,
)
from cp_core.testing import layout_cases, one_torch_thread

CP_SIZES = (1, 2, 3, 4, 8)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # Tiny tensors: OpenMP fork-join in ops like repeat_interleave costs more than the work on a busy box.
    with one_torch_thread():
        yield


TENSOR_FIELDS = ("cu_seqlens", "local_cu_seqlens", "local_doc_ids", "local_position_ids")

# --------------------------------------------------------------------------------------------------------
# Brute force: walk the row token by token in plain Python, no bisect, no tensors.


def brute_force_metadata(seq_lens: list[int], cp: int) -> list[dict]:
    """Every PackedRowMetadata field for every rank, from per-token tables."""
    doc_of: list[int] = []
    pos_of: list[int] = []
    for doc, length in enumerate(seq_lens):
        for pos in range(length):
            doc_of.append(doc)
            pos_of.append(pos)
    total = len(doc_of)
    local = total // cp
    rank_of = []
    for rank in range(cp):
        rank_of += [rank] * local
    first_token_of_doc: dict[int, int] = {}
    for token in range(total):
        if doc_of[token] not in first_token_of_doc:
            first_token_of_doc[doc_of[token]] = token
    cu = [0]
    for length in seq_lens:
        cu.append(cu[-1] + length)

    expected = []
    for rank in range(cp):
        mine = [t for t in range(total) if rank_of[t] == rank]
        start, end = mine[0], mine[-1] + 1
        runs: list[list[int]] = []  # [doc, count] run-length encoding of the shard's document ids
        for t in mine:
            if runs and runs[-1][0] == doc_of[t]:
                runs[-1][1] += 1
            else:
                runs.append([doc_of[t], 1])
        local_lens = [count for _, count in runs]
        local_cu = [0]
        for length in local_lens:
            local_cu.append(local_cu[-1] + length)
        first = doc_of[start]
        by_rank = []
        for other in range(cp):
            first_token = next(t for t in range(total) if rank_of[t] == other)
            by_rank.append(rank_of[first_token_of_doc[doc_of[first_token]]])
        expected.append(
            {
                "seq_lens": tuple(seq_lens),
                "total_len": total,
                "cp_rank": rank,
                "cp_size": cp,
                "cu_seqlens": cu,
                "max_seqlen": max(seq_lens),
                "shard_start": start,
                "shard_end": end,
                "local_seq_lens": tuple(local_lens),
                "local_cu_seqlens": local_cu,
                "local_max_seqlen": max(local_lens),
                "first_doc_index": first,
                "first_doc_starts_before": pos_of[start] > 0,
                "first_doc_start_rank": rank_of[first_token_of_doc[first]],
                "first_doc_tokens_before": pos_of[start],
                "last_doc_continues": end < total and doc_of[end] == doc_of[end - 1],
                "local_doc_ids": [doc_of[t] for t in mine],
                "local_position_ids": [pos_of[t] for t in mine],
                "doc_start_rank_by_rank": tuple(by_rank),
            }
        )
    return expected


TENSOR_DTYPES = {
    "cu_seqlens": torch.int32,
    "local_cu_seqlens": torch.int32,
    "local_doc_ids": torch.int32,
    "local_position_ids": torch.int64,
}


def assert_metadata_equals(meta: PackedRowMetadata, expected: dict, context: str) -> None:
    for name, want in expected.items():
        got = getattr(meta, name)
        if name in TENSOR_DTYPES:
            assert isinstance(got, torch.Tensor), f"{context}: {name} is not a tensor"
            assert got.dtype == TENSOR_DTYPES[name], f"{context}: {name} dtype {got.dtype}"
            assert got.device.type == "cpu", f"{context}: {name} on {got.device}"
            assert got.dim() == 1, f"{context}: {name} shape {tuple(got.shape)}"
            got = got.tolist()
        else:
            # Lengths and flags are host Python values (bool is an int, so check the exact type).
            assert type(got) is type(want), f"{context}: {name} is {type(got).__name__}, want {type(want).__name__}"
        assert got == want, f"{context}: {name} = {got}, brute force says {want}"
    assert meta.local_len == expected["shard_end"] - expected["shard_start"]
    assert meta.num_docs == len(expected["seq_lens"])
    assert meta.local_num_docs == len(expected["local_seq_lens"])


# --------------------------------------------------------------------------------------------------------
# Random layouts


def _lens_from_cuts(cuts: set[int], total: int) -> list[int]:
    points = sorted({0, total, *(c for c in cuts if 0 < c < total)})
    return [b - a for a, b in itertools.pairwise(points)]


def random_layout(rng: random.Random) -> tuple[list[int], int, str]:
    """A random row (document lengths), its cp, and which kind of layout it is."""
    cp = rng.choice(CP_SIZES)
    local = rng.randint(1, 12)
    total = cp * local
    shard_cuts = {r * local for r in range(1, cp)}
    kind = rng.choice(["random", "tiny", "on_boundaries", "single", "spanning", "mixed"])
    if kind == "random":
        cuts = set(rng.sample(range(1, total), rng.randint(0, total - 1))) if total > 1 else set()
    elif kind == "tiny":
        cuts, position = set(), 0
        while position < total:
            position += rng.randint(1, 3)
            cuts.add(position)
    elif kind == "on_boundaries":
        cuts = shard_cuts | {rng.randint(1, total) for _ in range(rng.randint(0, cp))}
    elif kind == "single":
        cuts = set()
    elif kind == "spanning":
        # One document from inside (or at the start of) rank a to inside (or at the end of) rank b >= a + 2.
        if cp >= 3:
            a = rng.randint(0, cp - 3)
            b = rng.randint(a + 2, cp - 1)
            start = a * local + rng.randint(0, local - 1)
            end = b * local + rng.randint(1, local)
        else:
            start, end = 0, total
        cuts = {start, end}
        cuts |= {rng.randint(1, start) for _ in range(rng.randint(0, 2)) if start > 1}
        cuts |= {rng.randint(end, total) for _ in range(rng.randint(0, 2)) if end < total}
    else:  # mixed: long documents and runs of 1-3 token documents
        cuts, position = set(), 0
        while position < total:
            position += rng.randint(1, 3) if rng.random() < 0.5 else rng.randint(1, 2 * local + 1)
            cuts.add(position)
    return _lens_from_cuts(cuts, total), cp, kind


def _spans_three_ranks(seq_lens: list[int], cp: int) -> bool:
    local = sum(seq_lens) // cp
    start = 0
    for length in seq_lens:
        if (start + length - 1) // local - start // local >= 2:
            return True
        start += length
    return False


def test_metadata_matches_brute_force_on_random_layouts():
    rng = random.Random(1234)
    coverage = dict.fromkeys(
        ("cp1", "cp2", "cp3", "cp4", "cp8", "tiny_doc", "cut_on_boundary", "single_doc_cp", "spans_3_ranks"), 0
    )
    num_layouts = 3000
    for index in range(num_layouts):
        seq_lens, cp, kind = random_layout(rng)
        total = sum(seq_lens)
        local = total // cp
        starts = {sum(seq_lens[:i]) for i in range(len(seq_lens))}
        coverage[f"cp{cp}"] += 1
        coverage["tiny_doc"] += any(length <= 3 for length in seq_lens)
        coverage["cut_on_boundary"] += any(r * local in starts for r in range(1, cp))
        coverage["single_doc_cp"] += len(seq_lens) == 1 and cp > 1
        coverage["spans_3_ranks"] += _spans_three_ranks(seq_lens, cp)
        expected = brute_force_metadata(seq_lens, cp)
        for rank in range(cp):
            context = f"layout #{index} ({kind}) seq_lens={seq_lens} cp={cp} rank={rank}"
            meta = build_packed_metadata(seq_lens, rank, cp)
            assert_metadata_equals(meta, expected[rank], context)
            if rank == cp - 1:  # total_len given explicitly and a tensor input give the same result
                meta = build_packed_metadata(torch.tensor(seq_lens), rank, cp, total_len=total)
                assert_metadata_equals(meta, expected[rank], context + " (tensor input)")
    # The generator really produced the layouts this test claims to cover.
    for name, count in coverage.items():
        assert count >= 100, f"only {count} layouts of kind {name}: {coverage}"


def test_metadata_hand_computed_example():
    # Row of 12 tokens over 3 ranks of 4: docs [0,3) [3,9) [9,10) [10,12).
    seq_lens = [3, 6, 1, 2]
    metas = [build_packed_metadata(seq_lens, rank, 3) for rank in range(3)]
    for meta in metas:
        assert meta.cu_seqlens.tolist() == [0, 3, 9, 10, 12]
        assert meta.max_seqlen == 6
        assert meta.doc_start_rank_by_rank == (0, 0, 0)
    m0, m1, m2 = metas
    assert (m0.shard_start, m0.shard_end, m1.shard_start, m2.shard_end) == (0, 4, 4, 12)
    assert m0.local_seq_lens == (3, 1) and m0.local_cu_seqlens.tolist() == [0, 3, 4] and m0.local_max_seqlen == 3
    assert m0.local_doc_ids.tolist() == [0, 0, 0, 1] and m0.local_position_ids.tolist() == [0, 1, 2, 0]
    assert (m0.first_doc_index, m0.first_doc_starts_before, m0.first_doc_start_rank) == (0, False, 0)
    assert (m0.first_doc_tokens_before, m0.last_doc_continues) == (0, True)
    assert m1.local_seq_lens == (4,) and m1.local_position_ids.tolist() == [1, 2, 3, 4]
    assert (m1.first_doc_index, m1.first_doc_starts_before, m1.first_doc_start_rank) == (1, True, 0)
    assert (m1.first_doc_tokens_before, m1.last_doc_continues) == (1, True)
    assert m2.local_seq_lens == (1, 1, 2) and m2.local_cu_seqlens.tolist() == [0, 1, 2, 4]
    assert m2.local_doc_ids.tolist() == [1, 2, 3, 3] and m2.local_position_ids.tolist() == [5, 0, 0, 1]
    assert (m2.first_doc_index, m2.first_doc_starts_before, m2.first_doc_tokens_before) == (1, True, 5)
    assert m2.last_doc_continues is False and m2.local_max_seqlen == 2

    # A document that starts on rank 1 and runs through rank 3: ranks 2 and 3 chain back to rank 1.
    meta = build_packed_metadata([5, 11], 3, 4)
    assert meta.doc_start_rank_by_rank == (0, 0, 1, 1)
    assert (meta.first_doc_index, meta.first_doc_start_rank, meta.first_doc_tokens_before) == (1, 1, 7)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16])
def test_seq_lens_tensor_input(dtype):
    lens = [5, 1, 9, 1]
    from_list = build_packed_metadata(lens, 1, 2)
    from_tensor = build_packed_metadata(torch.tensor(lens, dtype=dtype), 1, 2, total_len=16)
    assert from_tensor.seq_lens == (5, 1, 9, 1) and all(type(x) is int for x in from_tensor.seq_lens)
    for name in TENSOR_FIELDS:
        assert torch.equal(getattr(from_list, name), getattr(from_tensor, name)), name
    assert from_tensor.local_seq_lens == from_list.local_seq_lens == (7, 1)


def test_position_ids_from_seq_lens_matches_brute_force():
    rng = random.Random(7)
    for _ in range(500):
        seq_lens, _cp, _kind = random_layout(rng)
        expected = [pos for length in seq_lens for pos in range(length)]
        got = position_ids_from_seq_lens(seq_lens)
        assert got.dtype == torch.int64 and got.device.type == "cpu"
        assert got.tolist() == expected, seq_lens
        assert position_ids_from_seq_lens(torch.tensor(seq_lens)).tolist() == expected
    assert position_ids_from_seq_lens([3, 1, 2]).tolist() == [0, 1, 2, 0, 0, 1]
    with pytest.raises(ContextParallelError, match="positive"):
        position_ids_from_seq_lens([3, 0])


def test_cu_seqlens_from_lens():
    cu = cu_seqlens_from_lens([4, 1, 3])
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 4, 5, 8]


# --------------------------------------------------------------------------------------------------------
# Validation


@pytest.mark.parametrize(
    ("seq_lens", "total_len", "pattern"),
    [
        ([4, 0, 2], None, r"positive, got 0 in seq_lens=\[4, 0, 2\]"),
        ([4, -3, 2], None, r"positive, got -3 in seq_lens=\[4, -3, 2\]"),
        ([4, 2.0], None, r"Python ints, got 2\.0 of type float"),
        ([4, "2"], None, r"Python ints, got '2' of type str"),
        ([True, 3], None, r"Python ints, got True of type bool"),
        ([], None, "empty"),
        ((), None, "empty"),
        (torch.tensor([], dtype=torch.int64), None, "empty"),
        (torch.tensor([2.0, 3.0]), None, r"1-D integer tensor .*torch\.float32"),
        (torch.tensor([True, True]), None, r"1-D integer tensor .*torch\.bool"),
        (torch.tensor([[2, 3]]), None, r"1-D integer tensor .*shape \(1, 2\)"),
        (torch.tensor(5), None, r"1-D integer tensor .*shape \(\)"),
        (torch.tensor([3, 0]), None, "positive, got 0"),
        ([3, 4], 8, "seq_lens sum to 7 but the row has 8 tokens"),
        ([3, 4], 6, "seq_lens sum to 7 but the row has 6 tokens"),
        (torch.tensor([5, 5]), 12, "seq_lens sum to 10 but the row has 12 tokens"),
    ],
)
def test_normalize_seq_lens_rejects(seq_lens, total_len, pattern):
    with pytest.raises(ContextParallelError, match=pattern):
        normalize_seq_lens(seq_lens, total_len)
    with pytest.raises(ContextParallelError, match=pattern):
        build_packed_metadata(seq_lens, 0, 1, total_len=total_len)


def test_normalize_seq_lens_accepts():
    assert normalize_seq_lens([3, 1, 4]) == (3, 1, 4)
    assert normalize_seq_lens((3, 1, 4), total_len=8) == (3, 1, 4)
    assert normalize_seq_lens(torch.tensor([3, 1, 4], dtype=torch.int32), total_len=8) == (3, 1, 4)
    assert normalize_seq_lens(iter([2, 2])) == (2, 2)
    assert issubclass(ContextParallelError, ValueError)


def test_normalize_seq_lens_refuses_device_tensors():
    # A non-CPU tensor would need a device read; the meta device exercises the check without a GPU.
    with pytest.raises(ContextParallelError, match="must live on the CPU"):
        normalize_seq_lens(torch.tensor([3, 4], device="meta"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_normalize_seq_lens_refuses_cuda_tensors():
    with pytest.raises(ContextParallelError, match="must live on the CPU"):
        normalize_seq_lens(torch.tensor([3, 4], device="cuda"))


@pytest.mark.parametrize(
    ("total", "cp", "pad"),
    [(13, 4, 3), (4093, 4, 3), (4095, 8, 1), (7, 2, 1), (10, 3, 2), (1, 8, 7)],
)
def test_check_divisible_names_length_cp_and_padding(total, cp, pad):
    with pytest.raises(ContextParallelError) as info:
        check_divisible(total, cp)
    message = str(info.value)
    assert f"row length {total} is not divisible by cp={cp}" in message
    assert f"pad the row by {pad} token(s) (to {total + pad})" in message
    assert (total + pad) % cp == 0
    with pytest.raises(ContextParallelError, match=f"sequence length {total} .*pad the row by {pad} "):
        check_divisible(total, cp, what="sequence length")
    with pytest.raises(ContextParallelError, match=f"row length {total} is not divisible by cp={cp}; pad"):
        build_packed_metadata([total], 0, cp)


def test_check_divisible_accepts_multiples():
    for cp in CP_SIZES:
        for total in range(cp, 10 * cp + 1, cp):
            check_divisible(total, cp)  # does not raise


@pytest.mark.parametrize(("rank", "size"), [(2, 2), (-1, 2), (0, 0), (5, 4), (0, -1)])
def test_invalid_cp_rank(rank, size):
    with pytest.raises(ContextParallelError, match=f"invalid CP rank {rank} for cp={size}"):
        build_packed_metadata([8], rank, size)


def test_metadata_to_device():
    meta = build_packed_metadata([3, 6, 1, 2], 1, 3)
    same = meta.to("cpu")
    assert isinstance(same, PackedRowMetadata) and same is not meta
    for name in TENSOR_FIELDS:
        assert getattr(same, name).device.type == "cpu"
        assert torch.equal(getattr(same, name), getattr(meta, name))
        assert getattr(same, name).dtype == getattr(meta, name).dtype
    moved = meta.to(torch.device("meta"))
    for name in TENSOR_FIELDS:
        tensor = getattr(moved, name)
        assert tensor.device.type == "meta", name
        assert tensor.shape == getattr(meta, name).shape and tensor.dtype == getattr(meta, name).dtype
        assert getattr(meta, name).device.type == "cpu"  # the original is untouched
    assert meta.bounds is None and moved.bounds.device.type == "meta" and same.bounds.device.type == "cpu"
    host_fields = [f for f in PackedRowMetadata.__dataclass_fields__ if f not in (*TENSOR_FIELDS, "bounds")]
    assert len(host_fields) == 15
    for name in host_fields:
        assert getattr(moved, name) == getattr(meta, name), name


# --------------------------------------------------------------------------------------------------------
# layout_cases


LAYOUT_NAMES = {
    "single_document",
    "cuts_on_boundaries",
    "cuts_inside_documents",
    "spans_all_ranks",
    "tiny_documents",
    "mixed_random",
}


@pytest.mark.parametrize(
    ("total", "cp"),
    [(8, 1), (16, 1), (64, 1), (8, 2), (64, 2), (12, 3), (48, 3), (16, 4), (64, 4), (32, 8), (64, 8), (256, 8)],
)
def test_layout_cases_match_their_description(total, cp):
    local = total // cp
    shard_cuts = {r * local for r in range(1, cp)}
    for seed in range(8):
        cases = layout_cases(total, cp, seed=seed)
        assert set(cases) == LAYOUT_NAMES
        assert cases == layout_cases(total, cp, seed=seed)  # deterministic
        for name, lens in cases.items():
            context = f"{name} total={total} cp={cp} seed={seed}: {lens}"
            assert all(type(x) is int and x > 0 for x in lens), context
            assert sum(lens) == total, context
            for rank in range(cp):
                build_packed_metadata(lens, rank, cp, total_len=total)  # valid input for every rank
        assert cases["single_document"] == [total]

        def boundaries(lens):
            return {sum(lens[:i]) for i in range(1, len(lens))}

        bounds = boundaries(cases["cuts_on_boundaries"])
        assert shard_cuts <= bounds, f"cuts_on_boundaries {cases['cuts_on_boundaries']} misses a shard cut"
        bounds = boundaries(cases["cuts_inside_documents"])
        assert not shard_cuts & bounds, f"cuts_inside_documents {cases['cuts_inside_documents']} cuts on a boundary"
        assert max(cases["tiny_documents"]) <= 3

        # spans_all_ranks: one document holds tokens of every rank, starting inside the first shard and
        # (with more than one rank) ending inside the last.
        lens = cases["spans_all_ranks"]
        starts = [sum(lens[:i]) for i in range(len(lens))]
        spanning = [
            (s, s + n)
            for s, n in zip(starts, lens, strict=True)
            if {t // local for t in range(s, s + n)} == set(range(cp))
        ]
        assert spanning, f"spans_all_ranks {lens}: no document covers all {cp} ranks"
        if cp > 1:
            assert len(spanning) == 1, f"spans_all_ranks {lens}: {len(spanning)} documents span every rank"
            s, e = spanning[0]
            assert 0 < s < local, f"spans_all_ranks {lens}: starts at {s}, not inside the first shard"
            assert total - local < e < total, f"spans_all_ranks {lens}: ends at {e}, not inside the last shard"
        if cp > 2:  # middle ranks hold only that document's middle
            for rank in range(1, cp - 1):
                meta = build_packed_metadata(lens, rank, cp)
                assert meta.local_seq_lens == (local,) and meta.first_doc_starts_before and meta.last_doc_continues


def test_layout_cases_rejects_bad_sizes():
    with pytest.raises(ValueError, match="divisible"):
        layout_cases(10, 4)
    with pytest.raises(ValueError, match=">= 4 tokens a rank"):
        layout_cases(12, 4)
