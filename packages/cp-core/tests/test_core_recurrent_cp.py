"""Recurrent-layer CP on real gloo groups of 2 and 4 ranks: the causal conv (halo exchange), Mamba-2 SSD and the
gated delta rule (state passing) against their unsharded runs over every layout case, outputs and every gradient,
in fp32 and fp64; ``pass_states`` against a brute-force chain; and the errors every rank must raise alike."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
import torch.nn.functional as F

from cp_core import CPTopology, build_packed_metadata
from cp_core.conv import causal_conv1d_cp
from cp_core.gated_delta import PREPASS_SEGMENT_TOKENS, GatedDecay, gated_delta_rule_cp
from cp_core.packing import PackedRowMetadata
from cp_core.ssd import ssd_cp
from cp_core.state_passing import pass_states
from cp_core.testing import (
    CommCounter,
    GlooWorkers,
    RankFailure,
    check_cp_parity,
    layout_cases,
    one_torch_thread,
    saved_storages,
)

CP_SIZES = (2, 4)
TOTAL = {2: 48, 4: 64}  # row length per CP size: 24 and 16 tokens a rank
CONV_WIDTH = 4


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # The gloo workers share the 2 cores with this process; OpenMP spinning in here would starve them.
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def workers(request):
    """One pool per CP size for the whole module (tests pick the size by indirect parametrization)."""
    with GlooWorkers(request.param, timeout_s=120, collective_timeout_s=30) as pool:
        yield pool


# One parametrize of the pool shared by every test: pytest keys a parametrized fixture by the index of its value in
# the parameter list, so the pool of each size is spawned once for the module (a combined ("workers", "case")
# list would give every case its own index, and a pool of its own).
with_workers = pytest.mark.parametrize("workers", CP_SIZES, indirect=True, ids=lambda cp: f"cp{cp}")


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


# --------------------------------------------------------------------------------------------------------
# Layouts


def extra_layouts(cp: int) -> dict[str, list[int]]:
    """Boundary situations added to :func:`layout_cases` by hand."""
    total, local = TOTAL[cp], TOTAL[cp] // cp
    extras = {
        "all_single_tokens": [1] * total,
        # A 2-token document (shorter than W-1) cut in half: the halo holds one token of it and two of the
        # previous document, which must be masked.
        "short_doc_across_cut": [local - 1, 2, total - local - 1],
        # A document that starts on the last token of rank 0 and ends exactly on a shard boundary.
        "starts_on_last_token": [local - 1, local + 1] if cp == 2 else [local - 1, 2 * local + 1, local],
    }
    if cp == 4:
        # Ranks 1 and 2 hold only the middle of document 1; rank 3 continues it for 4 tokens, then 3 documents.
        extras["middle_only_ranks"] = [10, 42, 3, 1, 8]
        # Document 0 spans ranks 0..2; document 1 starts on rank 2 and goes on to rank 3.
        extras["two_chains"] = [40, 24]
    return extras


def all_layouts(cp: int) -> dict[str, list[int]]:
    layouts = {**layout_cases(TOTAL[cp], cp), **extra_layouts(cp)}
    for name, seq_lens in layouts.items():
        assert sum(seq_lens) == TOTAL[cp], name
    return layouts


@pytest.mark.parametrize("cp", CP_SIZES)
def test_layouts_cover_the_boundary_situations(cp):
    """Guard the coverage the parity tests rely on, whatever layout_cases generates."""
    layouts = all_layouts(cp)
    metas = {name: [build_packed_metadata(lens, r, cp) for r in range(cp)] for name, lens in layouts.items()}

    def some(predicate) -> list[str]:
        return [name for name, ranks in metas.items() if predicate(layouts[name], ranks)]

    # Documents shorter than the conv halo, and one of them cut by a shard boundary.
    assert some(lambda lens, _: min(lens) < CONV_WIDTH - 1)
    assert some(lambda _, ranks: any(0 < m.first_doc_tokens_before < CONV_WIDTH - 1 for m in ranks))
    # Every cut exactly at a document start.
    assert some(lambda lens, ranks: len(lens) > cp and not any(m.first_doc_starts_before for m in ranks))
    # One document spanning every rank (alone, and with other documents around it).
    assert some(lambda lens, _: len(lens) == 1)
    assert some(lambda lens, ranks: len(lens) > 1 and set(ranks[-1].doc_start_rank_by_rank) == {0})
    if cp == 4:  # a rank holding only the middle of one document needs a rank on each side of it
        assert some(
            lambda _, ranks: any(
                m.local_num_docs == 1 and m.first_doc_starts_before and m.last_doc_continues for m in ranks
            )
        )
        ranks = metas["middle_only_ranks"]
        assert [m.local_num_docs for m in ranks] == [2, 1, 1, 4]
        assert all(m.first_doc_starts_before and m.last_doc_continues for m in ranks[1:3])
        assert ranks[3].first_doc_starts_before and ranks[3].doc_start_rank_by_rank == (0, 0, 0, 0)


# --------------------------------------------------------------------------------------------------------
# Cases run on the workers (module level, so that they are importable by name)


def conv_case(
    module: None,
    metadata: PackedRowMetadata,
    topology: CPTopology,
    *,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    return causal_conv1d_cp(x, weight, bias, metadata, topology, activation=activation, backend="torch")


def ssd_case(
    module: None,
    metadata: PackedRowMetadata,
    topology: CPTopology,
    *,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
) -> torch.Tensor:
    return ssd_cp(x, dt, A, B, C, metadata, topology, D=D, backend="torch")


def gdn_case(
    module: None,
    metadata: PackedRowMetadata,
    topology: CPTopology,
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    qk_l2norm: bool = False,
    scale: float | None = None,
    segment: int | None = PREPASS_SEGMENT_TOKENS,
) -> torch.Tensor:
    return gated_delta_rule_cp(
        q, k, v, g, beta, metadata, topology, scale=scale, qk_l2norm=qk_l2norm, backend="torch",
        prepass_segment_tokens=segment,
    )  # fmt: skip


def gdn_gated_decay_case(
    module: None,
    metadata: PackedRowMetadata,
    topology: CPTopology,
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    b: torch.Tensor,
) -> torch.Tensor:
    """The decay as its inputs (how Qwen3.5 calls it): the pre-pass slices them as well."""
    decay = GatedDecay(a, A_log, dt_bias)
    return gated_delta_rule_cp(q, k, v, decay, b.sigmoid(), metadata, topology, qk_l2norm=True, backend="torch")


# --------------------------------------------------------------------------------------------------------
# Inputs


def conv_inputs(total: int, width: int, bias: bool, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    inputs = {"x": randn(total, 6, seed=seed, dtype=dtype), "weight": randn(6, width, seed=seed + 1, dtype=dtype)}
    if bias:
        inputs["bias"] = randn(6, seed=seed + 2, dtype=dtype)
    return inputs


CONV_SEQ_DIMS = {"x": 0, "weight": None, "bias": None}


# Weak decays (about exp(-0.1) a token, so a state keeps ~20% over a 16-token shard): a state that crosses two
# ranks still matters, so a wrong chain shows in the fp32 comparisons as well, not only in fp64.


def ssd_inputs(total: int, seed: int, dtype: torch.dtype, heads: int = 4, groups: int = 2) -> dict[str, torch.Tensor]:
    return {
        "x": randn(total, heads, 3, seed=seed, dtype=dtype),
        "dt": F.softplus(randn(total, heads, seed=seed + 1, dtype=torch.float64) - 2.5).to(dtype),
        "A": -randn(heads, seed=seed + 2, dtype=torch.float64).mul(0.5).exp().to(dtype),
        "B": randn(total, groups, 5, seed=seed + 3, dtype=dtype),
        "C": randn(total, groups, 5, seed=seed + 4, dtype=dtype),
        "D": randn(heads, seed=seed + 5, dtype=dtype),
    }


SSD_SEQ_DIMS = {"x": 0, "dt": 0, "B": 0, "C": 0, "A": None, "D": None}


def gdn_inputs(
    total: int, seed: int, dtype: torch.dtype, ratio: int = 1, key_heads: int = 2
) -> dict[str, torch.Tensor]:
    hv = key_heads * ratio
    return {
        "q": randn(total, key_heads, 4, seed=seed, dtype=dtype),
        # Keys of norm ~0.8 keep (I - beta k k^T) contractive when they are not l2-normalized.
        "k": (0.4 * randn(total, key_heads, 4, seed=seed + 1, dtype=torch.float64)).to(dtype),
        "v": randn(total, hv, 3, seed=seed + 2, dtype=dtype),
        "g": -F.softplus(randn(total, hv, seed=seed + 3, dtype=torch.float64) - 2.5).to(dtype),
        "beta": torch.sigmoid(randn(total, hv, seed=seed + 4, dtype=torch.float64)).to(dtype),
    }


GDN_SEQ_DIMS = dict.fromkeys(("q", "k", "v", "g", "beta"), 0)


def gdn_gated_decay_inputs(total: int, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Decay inputs whose ``-exp(A_log) softplus(a + dt_bias)`` is about -0.1 a token, like gdn_inputs' g."""
    inputs = {n: x for n, x in gdn_inputs(total, seed, dtype, ratio=2).items() if n not in ("g", "beta")}
    hv = inputs["v"].size(1)
    inputs["a"] = randn(total, hv, seed=seed + 5, dtype=dtype)
    inputs["A_log"] = (0.3 * randn(hv, seed=seed + 6, dtype=torch.float64)).to(dtype)
    inputs["dt_bias"] = (randn(hv, seed=seed + 7, dtype=torch.float64) - 2.5).to(dtype)
    inputs["b"] = randn(total, hv, seed=seed + 8, dtype=dtype)
    return inputs


GDN_GATED_DECAY_SEQ_DIMS = {"q": 0, "k": 0, "v": 0, "a": 0, "A_log": None, "dt_bias": None, "b": 0}

# name: (case, make_inputs(total, seed, dtype), seq_dims, expected gradient names)
CONV_CONFIGS = {
    "conv_w4_bias_silu": (functools.partial(conv_case, activation="silu"), CONV_WIDTH, True),
    "conv_w4_plain": (conv_case, CONV_WIDTH, False),
    "conv_w2_bias": (conv_case, 2, True),
    "conv_w3_silu": (functools.partial(conv_case, activation="silu"), 3, False),
}
GDN_CONFIGS = {
    "gdn_hv_eq_hk": (1, {}),
    "gdn_hv_2hk_l2norm": (2, {"qk_l2norm": True}),
    "gdn_hv_2hk_scale": (2, {"scale": 0.3}),
}


def configs() -> dict[str, tuple]:
    """Every primitive configuration: (case, make_inputs(total, seed, dtype), seq_dims)."""
    out: dict[str, tuple] = {}
    for name, (case, width, bias) in CONV_CONFIGS.items():
        make = functools.partial(lambda t, s, d, w, b: conv_inputs(t, w, b, s, d), w=width, b=bias)
        out[name] = (case, make, CONV_SEQ_DIMS)
    out["ssd_g2_h4"] = (ssd_case, ssd_inputs, SSD_SEQ_DIMS)
    out["ssd_g1_h4_no_d"] = (
        ssd_case,
        lambda t, s, d: {n: x for n, x in ssd_inputs(t, s, d, groups=1).items() if n != "D"},
        SSD_SEQ_DIMS,
    )
    for name, (ratio, options) in GDN_CONFIGS.items():
        out[name] = (functools.partial(gdn_case, **options), functools.partial(gdn_inputs, ratio=ratio), GDN_SEQ_DIMS)
    out["gdn_gated_decay"] = (gdn_gated_decay_case, gdn_gated_decay_inputs, GDN_GATED_DECAY_SEQ_DIMS)
    return out


CONFIGS = configs()

# fp32 tolerances (relative to each tensor's largest entry): 1e-5 for every output and gradient (observed: at most
# ~6e-7 for the conv and the gated delta rule, ~5e-7 for SSD but its grad.A), except SSD's grad.A. A is replicated,
# so grad.A is a reduction over every token of the row (each rank sums its own tokens, then the ranks' sums are
# added): its fp32 rounding differs from the unsharded sum's by up to ~3e-6 relative here, and by 1.08e-5 with
# stronger decays (dt ~ softplus(N(0, 1))). The fp64 test below runs the same cases and finds < 1e-10 for grad.A
# as for everything else, which proves the difference is rounding, not a CP error.
FP32_RTOL = 1e-5
FP32_RTOLS = {"ssd": {"grad.A": 1e-4}}


# Largest relative difference seen per primitive, precision and tensor (printed at module teardown with -s).
WORST: dict[str, dict[str, float]] = {}


@pytest.fixture(scope="module", autouse=True)
def _print_worst():
    yield
    for primitive, worst in sorted(WORST.items()):
        print(f"\n{primitive}: " + ", ".join(f"{n} {r:.2e}" for n, r in sorted(worst.items())))


def _record(config_name: str, dtype: str, relative: dict[str, float]) -> None:
    worst = WORST.setdefault(f"{config_name.split('_')[0]} {dtype}", {})
    for tensor, rel in relative.items():
        worst[tensor] = max(worst.get(tensor, 0.0), rel)


# --------------------------------------------------------------------------------------------------------
# Parity: sharded vs unsharded


@with_workers
@pytest.mark.parametrize("config_name", CONFIGS)
def test_recurrent_cp_parity_fp32(workers, config_name):
    cp = workers.world_size
    case, make_inputs, seq_dims = CONFIGS[config_name]
    rtols = FP32_RTOLS.get(config_name.split("_")[0], {})
    failures = []
    for index, (layout, seq_lens) in enumerate(all_layouts(cp).items()):
        seed = 1000 * cp + 37 * index
        inputs = make_inputs(TOTAL[cp], seed, torch.float32)
        report = check_cp_parity(workers, case, seq_lens=seq_lens, inputs=inputs, seq_dims=seq_dims, seed=seed)
        assert set(report.relative) == {"out", *(f"grad.{n}" for n in inputs)}, report.relative
        _record(config_name, "fp32", report.relative)
        try:
            report.assert_close(rtol=FP32_RTOL, rtols=rtols)
        except AssertionError as exc:
            failures.append(f"{layout} {seq_lens}: {exc}")
    assert not failures, f"cp={cp} {config_name}:\n" + "\n".join(failures)


@with_workers
@pytest.mark.parametrize("config_name", CONFIGS)
def test_recurrent_cp_parity_fp64_is_exact(workers, config_name):
    """The same cases in fp64: CP reorders only roundings, so it agrees to ~1e-14 (bound 1e-10)."""
    cp = workers.world_size
    case, make_inputs, seq_dims = CONFIGS[config_name]
    failures = []
    for index, (layout, seq_lens) in enumerate(all_layouts(cp).items()):
        seed = 2000 * cp + 37 * index
        inputs = make_inputs(TOTAL[cp], seed, torch.float64)
        report = check_cp_parity(workers, case, seq_lens=seq_lens, inputs=inputs, seq_dims=seq_dims, seed=seed)
        assert set(report.relative) == {"out", *(f"grad.{n}" for n in inputs)}, report.relative
        _record(config_name, "fp64", report.relative)
        try:
            report.assert_close(rtol=1e-10)
        except AssertionError as exc:
            failures.append(f"{layout} {seq_lens}: {exc}")
    assert not failures, f"cp={cp} {config_name}:\n" + "\n".join(failures)


def _local_only_case(module, metadata, topology, *, q, k, v, g, beta):
    """Deliberately wrong CP: the gated delta rule restarted from zero on every shard."""
    return gated_delta_rule_cp(q, k, v, g, beta, metadata, CPTopology.single(), backend="torch")


@with_workers
def test_parity_detects_a_missing_state_pass(workers):
    """The harness and these layouts do see a CP bug: dropping the state pass breaks parity wherever a document
    crosses a cut (the row is tiled by shard-sized documents only in the last check, where it is exact)."""
    cp = workers.world_size
    total = TOTAL[cp]
    inputs = gdn_inputs(total, 5, torch.float32, ratio=2)
    layouts = all_layouts(cp)
    for layout in ("single_document", "spans_all_ranks", "cuts_inside_documents"):
        report = check_cp_parity(
            workers, _local_only_case, seq_lens=layouts[layout], inputs=inputs, seq_dims=GDN_SEQ_DIMS
        )
        assert report.relative["out"] > 1e-3, (layout, str(report))
    report = check_cp_parity(
        workers, _local_only_case, seq_lens=[total // cp] * cp, inputs=inputs, seq_dims=GDN_SEQ_DIMS
    )
    report.assert_close(rtol=1e-6)


# --------------------------------------------------------------------------------------------------------
# The GDN pre-pass in checkpointed segments (long shards)

SEGMENT_LOCAL = 200  # tokens a rank: the pre-pass crosses several 64-token segments and ends on a partial one


def _segment_layouts(cp: int) -> dict[str, list[int]]:
    total = SEGMENT_LOCAL * cp
    rng = torch.Generator().manual_seed(cp)
    layouts = {
        "one_document": [total],  # middle ranks pass the state through: 200 = 64 + 64 + 64 + 8
        "tail_of_one_segment": [SEGMENT_LOCAL - 50, total - SEGMENT_LOCAL + 50],  # rank 0's pre-pass: 50 tokens
        "tail_of_two_segments": [SEGMENT_LOCAL - 70, total - SEGMENT_LOCAL + 70],  # 64 + 6
        "cut_on_a_segment_edge": [SEGMENT_LOCAL - 128, total - SEGMENT_LOCAL + 128],  # 64 + 64
    }
    for draw in range(3):  # random cuts, some documents spanning 3+ ranks at cp 4
        cuts = sorted(torch.randperm(total - 1, generator=rng)[: 2 + draw].add(1).tolist())
        layouts[f"random_{draw}"] = [b - a for a, b in itertools.pairwise([0, *cuts, total])]
    return layouts


@with_workers
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_gdn_prepass_in_segments_matches_unsharded(workers, dtype):
    """64-token checkpointed segments, one segment, and the unsegmented pre-pass all give the unsharded output
    and gradients (fp64: to rounding; fp32: 1e-5 of each tensor's largest entry)."""
    cp = workers.world_size
    rtol = 1e-10 if dtype == torch.float64 else FP32_RTOL
    failures = []
    for index, (layout, seq_lens) in enumerate(_segment_layouts(cp).items()):
        inputs = gdn_inputs(SEGMENT_LOCAL * cp, 300 + index, dtype, ratio=2)
        for segment in (64, 16384, None):
            case = functools.partial(gdn_case, qk_l2norm=True, segment=segment)
            report = check_cp_parity(workers, case, seq_lens=seq_lens, inputs=inputs, seq_dims=GDN_SEQ_DIMS)
            assert set(report.relative) == {"out", *(f"grad.{n}" for n in inputs)}, report.relative
            try:
                report.assert_close(rtol=rtol)
            except AssertionError as exc:
                failures.append(f"{layout} {seq_lens} segment={segment}: {exc}")
    assert not failures, f"cp={cp}:\n" + "\n".join(failures)


def _gdn_prepass_saved_bytes(topology, segment):
    """Bytes autograd keeps for backward on this rank, for a one-document row, with q, k and v views of one
    conv-output-like tensor as in Qwen3.5; also the bytes of that tensor, g and beta."""
    total = SEGMENT_LOCAL * topology.size
    metadata = build_packed_metadata([total], topology.rank, topology.size)
    inputs = gdn_inputs(total, 7, torch.float32, ratio=2)
    local = {n: x[metadata.shard_start : metadata.shard_end] for n, x in inputs.items()}
    widths = [local[n][0].numel() for n in ("q", "k", "v")]
    source = torch.cat([local[n].flatten(1) for n in ("q", "k", "v")], dim=1).requires_grad_()
    mixed = source * 1.0  # a non-leaf, like the conv output the model splits
    q, k, v = (part.unflatten(1, local[n].shape[1:]) for part, n in zip(mixed.split(widths, 1), "qkv", strict=True))
    g, beta = (local[n].clone().requires_grad_() for n in ("g", "beta"))
    out, saved = saved_storages(
        lambda: gated_delta_rule_cp(
            q, k, v, g, beta, metadata=metadata, topology=topology, backend="torch", prepass_segment_tokens=segment
        )
    )
    out.sum().backward()
    inputs_bytes = sum(t.untyped_storage().nbytes() for t in (mixed, g, beta))
    return sum(saved.values()), inputs_bytes


@with_workers
def test_segmented_prepass_keeps_less_for_backward(workers):
    """Over the last rank (no pre-pass, the same shard length), the checkpointed pre-pass keeps its inputs (the
    tensor q, k and v are views of, g and beta; on the fla path the main pass keeps beta itself, and the planner
    counts the other two) and its carried states; the unsegmented one keeps its own activations (here the torch
    reference's chunked tensors) on top: ranks 0 .. cp-2, the middle ones with the K identity columns."""
    segmented = workers.run(_gdn_prepass_saved_bytes, 64)
    whole = workers.run(_gdn_prepass_saved_bytes, None)
    assert segmented[-1] == whole[-1]
    state_bytes = 4 * 4 * 4 * (3 + 4)  # one fp32 [Hv, K, V + K] state (Hv 4, K 4, V 3)
    states = -(-SEGMENT_LOCAL // 64) + 2  # one per segment, the identity start, the passed transition
    for rank in range(workers.world_size - 1):
        (kept_segmented, inputs_bytes), (kept_whole, _) = segmented[rank], whole[rank]
        extra_segmented, extra_whole = kept_segmented - segmented[-1][0], kept_whole - whole[-1][0]
        assert 0 < extra_segmented <= inputs_bytes + states * state_bytes, (rank, segmented, whole)
        assert extra_whole > 3 * extra_segmented, (rank, segmented, whole)


# --------------------------------------------------------------------------------------------------------
# pass_states against a brute-force chain


def _pass_states_on_rank(topology, seq_lens, kind, states, transitions, grad_initials):
    rank = topology.rank
    metadata = build_packed_metadata(seq_lens, rank, topology.size)
    state = states[rank].clone().requires_grad_(True)
    transition = transitions[rank].clone().requires_grad_(True)
    initial = pass_states(state, transition, metadata, topology, kind)
    initial.backward(grad_initials[rank])
    return {
        "initial": initial.detach(),
        "grad_state": state.grad,
        "grad_transition": transition.grad,
        "start_ranks": metadata.doc_start_rank_by_rank,
    }


def brute_force_chain(seq_lens, cp, kind, states, transitions, grad_initials):
    """Every rank's first-document initial state chained in one process, and autograd's gradients of
    ``sum_r <grad_initial_r, S0_r>`` w.r.t. every rank's ``(S_ext, M)``."""
    states = states.clone().requires_grad_(True)
    transitions = transitions.clone().requires_grad_(True)
    total, local = sum(seq_lens), sum(seq_lens) // cp
    doc_starts = list(itertools.accumulate([0, *seq_lens]))
    initials = []
    for rank in range(cp):
        first_token = rank * local
        start_rank = max(s for s in doc_starts if s <= first_token) // local
        s0 = torch.zeros_like(states[0])
        for i in range(start_rank, rank):  # S0 = M_i S0 + S_ext_i along the ranks holding the document
            m = transitions[i]
            s0 = (m @ s0 if kind == "matrix" else m[:, None, None] * s0) + states[i]
        initials.append(s0)
    assert total == cp * local
    initials = torch.stack(initials)
    if not initials.requires_grad:  # no document crosses a cut: nothing is chained
        return initials, torch.zeros_like(states), torch.zeros_like(transitions)
    (initials * grad_initials).sum().backward()
    return initials.detach(), states.grad, transitions.grad


def _chain_layouts(cp: int) -> list[list[int]]:
    if cp == 2:
        return [[8], [3, 5], [4, 4], [5, 3], [1] * 8, [2, 6]]
    # [10, 6]: document 0 spans ranks 0..2, document 1 ranks 2..3. [2, 13, 1]: document 1 spans ranks 0..3.
    return [[10, 6], [16], [4, 4, 4, 4], [2, 13, 1], [1] * 16, [6, 10], [4, 9, 3]]


@with_workers
@pytest.mark.parametrize("kind", ["matrix", "scalar"])
def test_pass_states_matches_brute_force_chain(workers, kind):
    cp = workers.world_size
    heads, k, v = 3, 4, 2
    for index, seq_lens in enumerate(_chain_layouts(cp)):
        seed = 10 * index + cp
        states = randn(cp, heads, k, v, seed=seed, dtype=torch.float64)
        if kind == "matrix":
            transitions = randn(cp, heads, k, k, seed=seed + 1, dtype=torch.float64) * 0.5
        else:
            transitions = torch.rand(cp, heads, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
        grad_initials = randn(cp, heads, k, v, seed=seed + 2, dtype=torch.float64)
        results = workers.run(_pass_states_on_rank, seq_lens, kind, states, transitions, grad_initials)
        expected, grad_states, grad_transitions = brute_force_chain(
            seq_lens, cp, kind, states, transitions, grad_initials
        )
        for rank, result in enumerate(results):
            context = f"{kind} seq_lens={seq_lens} rank={rank}"
            assert result["initial"].dtype == torch.float64, context
            assert torch.allclose(result["initial"], expected[rank], rtol=1e-12, atol=1e-12), context
            assert torch.allclose(result["grad_state"], grad_states[rank], rtol=1e-12, atol=1e-12), context
            assert torch.allclose(result["grad_transition"], grad_transitions[rank], rtol=1e-12, atol=1e-12), context
            if result["start_ranks"][rank] == rank:  # the first document starts here: nothing comes in
                assert torch.all(result["initial"] == 0), context
        # Something actually travelled (every layout but the shard-aligned ones chains at least one hop).
        chained = any(result["start_ranks"][r] < r for r, result in enumerate(results))
        assert chained == bool(expected.abs().sum() > 0), seq_lens


def _pass_states_traffic(topology, seq_lens):
    """The collectives one ``pass_states`` forward + backward issues on this rank: (op, bytes sent) each."""
    metadata = build_packed_metadata(seq_lens, topology.rank, topology.size)
    state = torch.randn(3, 4, 2, dtype=torch.float64, requires_grad=True)
    transition = torch.randn(3, 4, 4, dtype=torch.float64, requires_grad=True)
    with CommCounter(topology.size) as counter:
        pass_states(state, transition, metadata, topology, "matrix").sum().backward()
    return [(r.op, r.sent_bytes) for r in counter.records]


@with_workers
def test_pass_states_is_a_point_to_point_chain(workers):
    """The state travels rank to rank by send / recv, nothing is all-gathered: with one document over every rank,
    rank r receives its initial state from r - 1 and sends one state on to r + 1, and the backward sends one
    gradient back the other way."""
    cp = workers.world_size
    state_bytes = 3 * 4 * 2 * 8
    for rank, ops in enumerate(workers.run(_pass_states_traffic, [cp * 4])):
        assert ops and all("send" in op or "recv" in op for op, _ in ops), (rank, ops)
        sends = [sent for op, sent in ops if "send" in op]
        assert sends == [state_bytes] * ((rank < cp - 1) + (rank > 0)), (rank, ops)


@with_workers
def test_pass_states_fp32_inputs(workers):
    """fp32 inputs: an fp32 result equal to the chain computed in fp64, to fp32 rounding."""
    cp = workers.world_size
    heads, k, v = 2, 3, 2
    seq_lens = [1, 4 * cp - 2, 1]  # one document from rank 0 to the last rank
    states = randn(cp, heads, k, v, seed=3)
    transitions = torch.rand(cp, heads, generator=torch.Generator().manual_seed(4))
    grad_initials = randn(cp, heads, k, v, seed=5)
    results = workers.run(_pass_states_on_rank, seq_lens, "scalar", states, transitions, grad_initials)
    expected, grad_states, grad_transitions = brute_force_chain(
        seq_lens, cp, "scalar", states.double(), transitions.double(), grad_initials.double()
    )
    for rank, result in enumerate(results):
        assert result["initial"].dtype == result["grad_state"].dtype == torch.float32
        assert torch.allclose(result["initial"].double(), expected[rank], rtol=1e-6, atol=1e-6), rank
        assert torch.allclose(result["grad_state"].double(), grad_states[rank], rtol=1e-6, atol=1e-6), rank
        assert torch.allclose(result["grad_transition"].double(), grad_transitions[rank], rtol=1e-6, atol=1e-6), rank


# --------------------------------------------------------------------------------------------------------
# Errors raised alike on every rank


def _conv_on_short_shards(topology, total, width):
    metadata = build_packed_metadata([total], topology.rank, topology.size)
    x = torch.randn(metadata.local_len, 3)
    return causal_conv1d_cp(x, torch.randn(3, width), None, metadata, topology, backend="torch").shape


def _pass_states_with_wrong_metadata(topology):
    metadata = build_packed_metadata([8], 0, 1)  # built for no CP
    return pass_states(torch.zeros(2, 3, 3), torch.zeros(2, 3, 3), metadata, topology, "matrix")


def _every_rank_raised(results: list, cp: int, type_name: str, message: str) -> None:
    assert len(results) == cp
    for rank, result in enumerate(results):
        assert isinstance(result, RankFailure), (rank, result)
        assert result.rank == rank
        assert result.type_name == type_name, (rank, result.type_name, result.message)
        assert message in result.message, (rank, result.message)


@with_workers
def test_errors_are_raised_on_every_rank(workers):
    cp = workers.world_size
    # Shards of 2 tokens cannot feed a halo of W-1 = 3: every rank raises before any exchange.
    results = workers.run_collect(_conv_on_short_shards, 2 * cp, 4)
    _every_rank_raised(results, cp, "ContextParallelError", "each CP shard must hold at least W-1=3 tokens")
    results = workers.run_collect(_conv_on_short_shards, 2 * cp, 5)
    _every_rank_raised(results, cp, "ContextParallelError", "at least W-1=4 tokens")
    # The same shards are long enough for W = 3 (the halo is the whole previous shard); the pool still works.
    assert workers.run(_conv_on_short_shards, 2 * cp, 3) == [torch.Size([2, 3])] * cp
    results = workers.run_collect(_pass_states_with_wrong_metadata)
    _every_rank_raised(results, cp, "ContextParallelError", "metadata is for rank 0 of cp=1, topology is rank")


@with_workers
def test_conv_halo_is_the_whole_previous_shard(workers):
    """Shards of exactly W-1 tokens: the halo is the previous rank's whole shard, and may span several documents."""
    cp = workers.world_size
    total = 2 * cp
    for index, seq_lens in enumerate([[total], [1] * total, [1, total - 2, 1], [3, total - 3]]):
        inputs = conv_inputs(total, 3, True, seed=index, dtype=torch.float64)
        report = check_cp_parity(workers, conv_case, seq_lens=seq_lens, inputs=inputs, seq_dims=CONV_SEQ_DIMS)
        report.assert_close(rtol=1e-12)
