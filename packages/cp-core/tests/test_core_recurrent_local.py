"""Single-process checks of the recurrent primitives: the chunked torch forms of SSD and the gated delta rule
against their per-token recurrences (outputs, final states and every gradient), the shift-and-add conv against
per-document ``F.conv1d``, the document-aligned chunk layout, backend selection and input validation."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from cp_core import ContextParallelError, CPTopology, build_packed_metadata
from cp_core.chunking import build_chunk_layout
from cp_core.conv import causal_conv1d, causal_conv1d_cp, naive_causal_conv1d
from cp_core.gated_delta import (
    GatedDecay,
    chunk_gated_delta_rule_torch,
    gated_delta_rule,
    gated_delta_rule_cp,
    naive_recurrent_gated_delta_rule,
)
from cp_core.recurrent_backends import resolve_recurrent_backend
from cp_core.ssd import chunk_ssd_torch, naive_recurrent_ssd, ssd, ssd_cp
from cp_core.state_passing import pass_states
from cp_core.testing import one_torch_thread, relative_max

# Documents of 1-3 tokens; one document longer than every chunk size below 64 and not a multiple of 4 or 8;
# a mix with lengths that are and are not multiples of the chunk size; a document longer than 64.
LAYOUTS = {
    "tiny": [1, 2, 3, 1, 1, 2, 3, 2],
    "one_long": [45],
    "mixed": [9, 1, 16, 3, 24, 2],
    "beyond_64": [70, 5],
}
CHUNK_SIZES = (4, 8, 64)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # Small tensors: intra-op threads only contend (with each other and with concurrent test processes).
    with one_torch_thread():
        yield


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def max_abs(got: torch.Tensor, expected: torch.Tensor) -> float:
    return (got.double() - expected.double()).abs().max().item()


def grads_of(fn, inputs: dict[str, torch.Tensor], seed: int) -> tuple[tuple[torch.Tensor, ...], dict]:
    """Outputs of ``fn(**inputs)`` and the gradients of every input for fixed random output gradients."""
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in inputs.items()}
    outputs = fn(**leaves)
    loss = sum((out * randn(*out.shape, seed=seed + i, dtype=out.dtype)).sum() for i, out in enumerate(outputs))
    loss.backward()
    return tuple(o.detach() for o in outputs), {n: t.grad for n, t in leaves.items()}


# --------------------------------------------------------------------------------------------------------
# SSD


def ssd_inputs(seq_lens, heads=4, groups=2, p=3, n=5, *, seed, dtype=torch.float64, initial=False, with_d=True):
    t = sum(seq_lens)
    inputs = {
        "x": randn(t, heads, p, seed=seed, dtype=dtype),
        "dt": F.softplus(randn(t, heads, seed=seed + 1)).to(dtype),
        "A": -randn(heads, seed=seed + 2).mul(0.5).exp().to(dtype),
        "B": randn(t, groups, n, seed=seed + 3, dtype=dtype),
        "C": randn(t, groups, n, seed=seed + 4, dtype=dtype),
    }
    if with_d:
        inputs["D"] = randn(heads, seed=seed + 5, dtype=dtype)
    if initial:
        inputs["initial_state"] = randn(len(seq_lens), heads, p, n, seed=seed + 6, dtype=dtype)
    return inputs


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("initial", [False, True], ids=["zero_init", "initial_state"])
def test_chunk_ssd_matches_naive_fp64(layout, chunk_size, initial):
    seq_lens = LAYOUTS[layout]
    inputs = ssd_inputs(seq_lens, seed=chunk_size, initial=initial, with_d=not initial)
    y_ref, s_ref = naive_recurrent_ssd(**inputs, seq_lens=seq_lens)
    y, s = chunk_ssd_torch(**inputs, seq_lens=seq_lens, chunk_size=chunk_size)
    assert y.dtype == s.dtype == torch.float64
    assert y.shape == inputs["x"].shape
    assert s.shape == (len(seq_lens), 4, 3, 5)
    assert max_abs(y, y_ref) < 1e-10
    assert max_abs(s, s_ref) < 1e-10


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_chunk_ssd_matches_naive_fp32(chunk_size):
    for index, (layout, seq_lens) in enumerate(LAYOUTS.items()):
        inputs = ssd_inputs(seq_lens, seed=10 * index, dtype=torch.float32, initial=index % 2 == 1)
        y, s = chunk_ssd_torch(**inputs, seq_lens=seq_lens, chunk_size=chunk_size)
        assert y.dtype == torch.float32
        # The truth: the per-token recurrence on the same (fp32-rounded) values, in fp64.
        y_ref, s_ref = naive_recurrent_ssd(**{n: t.double() for n, t in inputs.items()}, seq_lens=seq_lens)
        assert relative_max(y, y_ref) < 1e-5, layout
        assert relative_max(s, s_ref) < 1e-5, layout
        y_naive32, _ = naive_recurrent_ssd(**inputs, seq_lens=seq_lens)
        assert relative_max(y, y_naive32) < 1e-5, layout


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
@pytest.mark.parametrize("layout", ["tiny", "mixed", "beyond_64"])
def test_chunk_ssd_gradients_match_naive_fp64(layout, chunk_size):
    seq_lens = LAYOUTS[layout]
    inputs = ssd_inputs(seq_lens, seed=7 + chunk_size, initial=True)

    def chunked(**kw):
        return chunk_ssd_torch(**kw, seq_lens=seq_lens, chunk_size=chunk_size)

    def naive(**kw):
        return naive_recurrent_ssd(**kw, seq_lens=seq_lens)

    (y, s), grads = grads_of(chunked, inputs, seed=3)
    (y_ref, s_ref), grads_ref = grads_of(naive, inputs, seed=3)
    assert max_abs(y, y_ref) < 1e-10 and max_abs(s, s_ref) < 1e-10
    assert set(grads) == {"x", "dt", "A", "B", "C", "D", "initial_state"}
    for name, grad in grads.items():
        assert grad is not None and grads_ref[name] is not None, name
        assert grad.abs().max() > 0, name
        assert relative_max(grad, grads_ref[name]) < 1e-9, (name, relative_max(grad, grads_ref[name]))


def test_ssd_recurrence_by_hand():
    """The oracle itself: one head, one group, scalar state, checked against the formula written out."""
    x, dt = torch.tensor([[[1.0]], [[2.0]], [[-1.0]]], dtype=torch.float64), torch.tensor([[0.5], [1.0], [2.0]])
    a, b, c, d = (
        torch.tensor([-1.0]),
        torch.tensor([[[3.0]], [[1.0]], [[2.0]]]),
        torch.tensor([[[1.0]], [[2.0]], [[0.5]]]),
        0.25,
    )
    args = (x, dt.double(), a.double(), b.double(), c.double())
    y, final = naive_recurrent_ssd(*args, seq_lens=[2, 1], D=torch.tensor([d], dtype=torch.float64))
    s1 = 0.5 * 1.0 * 3.0
    s2 = math.exp(-1.0 * 1.0) * s1 + 1.0 * 2.0 * 1.0
    s3 = 2.0 * -1.0 * 2.0  # a new document: the state restarts
    expected = torch.tensor([s1 * 1.0 + d * 1.0, s2 * 2.0 + d * 2.0, s3 * 0.5 + d * -1.0], dtype=torch.float64)
    assert torch.allclose(y.flatten(), expected, rtol=0, atol=1e-14)
    assert torch.allclose(final.flatten(), torch.tensor([s2, s3], dtype=torch.float64), rtol=0, atol=1e-14)
    chunked, chunked_final = chunk_ssd_torch(*args, seq_lens=[2, 1], D=torch.tensor([d], dtype=torch.float64))
    assert torch.allclose(chunked.flatten(), expected, rtol=0, atol=1e-14)
    assert torch.allclose(chunked_final.flatten(), final.flatten(), rtol=0, atol=1e-14)


def test_ssd_without_cp_is_the_local_run():
    seq_lens = LAYOUTS["mixed"]
    inputs = ssd_inputs(seq_lens, seed=5)
    metadata = build_packed_metadata(seq_lens)
    y = ssd_cp(**inputs, metadata=metadata, topology=CPTopology.single(), backend="torch")
    y_ref, _ = ssd(**inputs, seq_lens=seq_lens, backend="torch")
    assert torch.equal(y, y_ref)


def test_ssd_last_final_state_only():
    seq_lens = LAYOUTS["mixed"]
    inputs = ssd_inputs(seq_lens, seed=6)
    y, finals = ssd(**inputs, seq_lens=seq_lens, backend="torch")
    y_last, last = ssd(**inputs, seq_lens=seq_lens, backend="torch", final_states="last")
    assert len(seq_lens) > 1 and last.shape == (1, *finals.shape[1:])
    assert torch.equal(y_last, y) and torch.equal(last, finals[-1:])
    with pytest.raises(ContextParallelError, match="final_states must be 'all' or 'last', got 'first'"):
        ssd(**inputs, seq_lens=seq_lens, backend="torch", final_states="first")


# --------------------------------------------------------------------------------------------------------
# Gated delta rule


def gdn_inputs(seq_lens, key_heads=2, ratio=1, dk=4, dv=3, *, seed, dtype=torch.float64, initial=False):
    t, hv = sum(seq_lens), key_heads * ratio
    inputs = {
        "q": randn(t, key_heads, dk, seed=seed, dtype=dtype),
        # Keys of norm ~0.8 keep (I - beta k k^T) contractive when they are not l2-normalized.
        "k": (0.4 * randn(t, key_heads, dk, seed=seed + 1)).to(dtype),
        "v": randn(t, hv, dv, seed=seed + 2, dtype=dtype),
        "g": -F.softplus(randn(t, hv, seed=seed + 3)).to(dtype),
        "beta": torch.sigmoid(randn(t, hv, seed=seed + 4)).to(dtype),
    }
    if initial:
        inputs["initial_state"] = randn(len(seq_lens), hv, dk, dv, seed=seed + 5, dtype=dtype)
    return inputs


# (value heads per key head, qk_l2norm, scale, initial_state)
GDN_CONFIGS = [(1, False, None, False), (2, True, None, True), (2, False, 0.3, True), (1, True, 0.7, False)]


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_chunk_gated_delta_matches_naive_fp64(layout, chunk_size):
    seq_lens = LAYOUTS[layout]
    for ratio, l2, scale, initial in GDN_CONFIGS:
        inputs = gdn_inputs(seq_lens, ratio=ratio, seed=chunk_size + ratio, initial=initial)
        options = {"seq_lens": seq_lens, "scale": scale, "qk_l2norm": l2}
        o_ref, s_ref = naive_recurrent_gated_delta_rule(**inputs, **options)
        o, s = chunk_gated_delta_rule_torch(**inputs, **options, chunk_size=chunk_size)
        context = (ratio, l2, scale, initial)
        assert o.dtype == s.dtype == torch.float64
        assert o.shape == inputs["v"].shape and s.shape == (len(seq_lens), 2 * ratio, 4, 3), context
        assert max_abs(o, o_ref) < 1e-10, context
        assert max_abs(s, s_ref) < 1e-10, context


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_chunk_gated_delta_matches_naive_fp32(chunk_size):
    for (layout, seq_lens), (ratio, l2, scale, initial) in itertools.product(LAYOUTS.items(), GDN_CONFIGS):
        inputs = gdn_inputs(seq_lens, ratio=ratio, seed=chunk_size, dtype=torch.float32, initial=initial)
        options = {"seq_lens": seq_lens, "scale": scale, "qk_l2norm": l2}
        o, s = chunk_gated_delta_rule_torch(**inputs, **options, chunk_size=chunk_size)
        assert o.dtype == torch.float32
        o_ref, s_ref = naive_recurrent_gated_delta_rule(**{n: t.double() for n, t in inputs.items()}, **options)
        context = (layout, ratio, l2, scale, initial)
        assert relative_max(o, o_ref) < 1e-5, (context, relative_max(o, o_ref))
        assert relative_max(s, s_ref) < 1e-5, (context, relative_max(s, s_ref))


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
@pytest.mark.parametrize("layout", ["tiny", "mixed", "beyond_64"])
def test_chunk_gated_delta_gradients_match_naive_fp64(layout, chunk_size):
    seq_lens = LAYOUTS[layout]
    for ratio, l2, scale, _ in GDN_CONFIGS:
        inputs = gdn_inputs(seq_lens, ratio=ratio, seed=11 + chunk_size, initial=True)
        options = {"seq_lens": seq_lens, "scale": scale, "qk_l2norm": l2}

        def chunked(options=options, **kw):
            return chunk_gated_delta_rule_torch(**kw, **options, chunk_size=chunk_size)

        def naive(options=options, **kw):
            return naive_recurrent_gated_delta_rule(**kw, **options)

        (o, s), grads = grads_of(chunked, inputs, seed=4)
        (o_ref, s_ref), grads_ref = grads_of(naive, inputs, seed=4)
        context = (ratio, l2, scale)
        assert max_abs(o, o_ref) < 1e-10 and max_abs(s, s_ref) < 1e-10, context
        assert set(grads) == {"q", "k", "v", "g", "beta", "initial_state"}
        for name, grad in grads.items():
            assert grad is not None and grads_ref[name] is not None, (context, name)
            assert grad.abs().max() > 0, (context, name)
            assert relative_max(grad, grads_ref[name]) < 1e-9, (context, name, relative_max(grad, grads_ref[name]))


def test_gated_delta_rule_by_hand():
    """The oracle itself: one head, K = V = 1, against the scalar recurrence written out."""
    q, k, v = (
        torch.tensor(vals, dtype=torch.float64).view(3, 1, 1)
        for vals in ([1.0, 2.0, -1.0], [0.5, 1.0, 2.0], [2.0, -1.0, 3.0])
    )
    g = torch.tensor([[-0.1], [-0.5], [-0.2]], dtype=torch.float64)
    beta = torch.tensor([[0.5], [0.25], [1.0]], dtype=torch.float64)
    scale = 0.5
    o, final = naive_recurrent_gated_delta_rule(q, k, v, g, beta, seq_lens=[3], scale=scale)
    s, expected = 0.0, []
    for t in range(3):
        kt, vt, bt, gt = k[t].item(), v[t].item(), beta[t].item(), g[t].item()
        s = math.exp(gt) * (1 - bt * kt * kt) * s + bt * kt * vt
        expected.append(scale * s * q[t].item())
    assert torch.allclose(o.flatten(), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-14)
    assert abs(final.item() - s) < 1e-14


def test_gated_delta_without_cp_is_the_local_run():
    seq_lens = LAYOUTS["mixed"]
    inputs = gdn_inputs(seq_lens, ratio=2, seed=3)
    metadata = build_packed_metadata(seq_lens)
    o = gated_delta_rule_cp(**inputs, metadata=metadata, topology=CPTopology.single(), qk_l2norm=True, backend="torch")
    o_ref, _ = gated_delta_rule(**inputs, seq_lens=seq_lens, qk_l2norm=True, backend="torch")
    assert torch.equal(o, o_ref)


def test_gated_decay_equals_the_explicit_log_decay():
    """g given as its inputs (GatedDecay): the same output and gradients, through a, A_log, dt_bias and beta, as
    the explicit ``-exp(A_log) softplus(a + dt_bias)`` (fp64)."""
    seq_lens = LAYOUTS["mixed"]
    base = gdn_inputs(seq_lens, ratio=2, seed=21)
    t, hv = base["beta"].shape
    raw = {
        "a": randn(t, hv, seed=22),
        "A_log": 0.3 * randn(hv, seed=23),
        "dt_bias": randn(hv, seed=24) - 1,
        "b": randn(t, hv, seed=25),
    }

    def run(explicit: bool):
        leaves = {n: x.detach().clone().requires_grad_() for n, x in raw.items()}
        if explicit:
            g = -leaves["A_log"].exp() * F.softplus(leaves["a"] + leaves["dt_bias"])
        else:
            g = GatedDecay(leaves["a"], leaves["A_log"], leaves["dt_bias"])
        o = gated_delta_rule_cp(
            base["q"], base["k"], base["v"], g, leaves["b"].sigmoid(), build_packed_metadata(seq_lens),
            CPTopology.single(), qk_l2norm=True, backend="torch",
        )  # fmt: skip
        o.backward(randn(*o.shape, seed=26))
        return o, {n: x.grad for n, x in leaves.items()}

    (o, grads), (o_ref, grads_ref) = run(False), run(True)
    assert max_abs(o, o_ref) < 1e-12
    for name in raw:
        assert grads_ref[name].abs().max() > 1e-3, name  # the gradient reaches every input
        assert max_abs(grads[name], grads_ref[name]) < 1e-12, name
    assert GatedDecay(raw["a"], raw["A_log"])[2:5].shape == (3, hv)


# --------------------------------------------------------------------------------------------------------
# Causal conv


CONV_LAYOUTS = {"short_docs": [1, 2, 1, 5, 3, 1, 2], "one_doc": [13], "mixed": [2, 9, 1, 4]}


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("width", [2, 3, 4])
def test_causal_conv_matches_naive(width, with_bias, activation):
    channels = 5
    for index, (layout, seq_lens) in enumerate(CONV_LAYOUTS.items()):
        t = sum(seq_lens)
        inputs = {"x": randn(t, channels, seed=index), "weight": randn(channels, width, seed=index + 1)}
        if with_bias:
            inputs["bias"] = randn(channels, seed=index + 2)

        def shifted(seq_lens=seq_lens, **kw):
            return (causal_conv1d(**kw, activation=activation, seq_lens=seq_lens, backend="torch"),)

        def naive(seq_lens=seq_lens, **kw):
            return (naive_causal_conv1d(**kw, activation=activation, seq_lens=seq_lens),)

        (y,), grads = grads_of(shifted, inputs, seed=9)
        (y_ref,), grads_ref = grads_of(naive, inputs, seed=9)
        assert y.shape == (t, channels)
        assert max_abs(y, y_ref) < 1e-12, layout
        for name, grad in grads.items():
            assert relative_max(grad, grads_ref[name]) < 1e-12, (layout, name)


def test_causal_conv_by_hand():
    """Explicit taps: weight[:, W-1] multiplies the current token, and nothing crosses a document start."""
    x = torch.tensor([[1.0], [2.0], [4.0], [8.0], [16.0]], dtype=torch.float64)
    weight = torch.tensor([[100.0, 10.0, 1.0]], dtype=torch.float64)
    bias = torch.tensor([0.5], dtype=torch.float64)
    y = causal_conv1d(x, weight, bias, seq_lens=[3, 2], backend="torch")
    expected = [1 + 0.5, 2 + 10 + 0.5, 4 + 20 + 100 + 0.5, 8 + 0.5, 16 + 80 + 0.5]
    assert y.flatten().tolist() == expected
    assert naive_causal_conv1d(x, weight, bias, seq_lens=[3, 2]).flatten().tolist() == expected
    silu = causal_conv1d(x, weight, bias, "silu", seq_lens=[3, 2], backend="torch")
    assert torch.allclose(silu, F.silu(torch.tensor(expected, dtype=torch.float64)).view(5, 1), rtol=0, atol=1e-12)


def test_causal_conv_cp_without_cp_is_the_local_run():
    seq_lens = CONV_LAYOUTS["mixed"]
    x, weight = randn(sum(seq_lens), 3, seed=1), randn(3, 4, seed=2)
    metadata = build_packed_metadata(seq_lens)
    y = causal_conv1d_cp(x, weight, None, metadata, CPTopology.single(), activation="silu", backend="torch")
    assert torch.equal(y, causal_conv1d(x, weight, None, "silu", seq_lens=seq_lens, backend="torch"))


# --------------------------------------------------------------------------------------------------------
# Chunk layout


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 8, 64])
def test_chunk_layout_round_trip_and_document_alignment(chunk_size):
    for seq_lens in [*LAYOUTS.values(), [1], [8, 8], [63, 64, 65]]:
        total = sum(seq_lens)
        layout = build_chunk_layout(seq_lens, chunk_size)
        expected_chunks = [-(-length // chunk_size) for length in seq_lens]
        assert layout.num_chunks == sum(expected_chunks)
        assert layout.token_index.shape == layout.valid.shape == (layout.num_chunks, chunk_size)
        assert layout.num_tokens == total and int(layout.valid.sum()) == total
        x = randn(total, 3, 2, seed=chunk_size)
        chunks = layout.gather(x)
        assert chunks.shape == (layout.num_chunks, chunk_size, 3, 2)
        assert torch.equal(layout.scatter(chunks), x)
        assert torch.all(chunks[~layout.valid] == 0)  # padding slots read the zero row
        assert torch.all(layout.token_index[~layout.valid] == total)
        # Every chunk holds tokens of one document only, in order, from the document's own chunk grid.
        doc_of_token = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens))
        starts = [0, *itertools.accumulate(seq_lens)]
        for c in range(layout.num_chunks):
            tokens = layout.token_index[c][layout.valid[c]]
            assert len(tokens) > 0
            assert torch.all(layout.valid[c][: len(tokens)])  # padding only at the end
            docs = doc_of_token[tokens].unique().tolist()
            assert docs == [layout.chunk_doc[c]], (seq_lens, c)
            assert torch.equal(tokens, torch.arange(tokens[0], tokens[0] + len(tokens)))
            assert (int(tokens[0]) - starts[docs[0]]) % chunk_size == 0
            assert layout.chunk_starts_doc[c] == (int(tokens[0]) == starts[docs[0]])
        assert list(layout.doc_last_chunk) == [sum(expected_chunks[: d + 1]) - 1 for d in range(len(seq_lens))]
        # Scatter is the adjoint of gather: gradients flow back to every token exactly once.
        leaf = x.clone().requires_grad_(True)
        layout.scatter(layout.gather(leaf) * 2).sum().backward()
        assert torch.all(leaf.grad == 2)


# --------------------------------------------------------------------------------------------------------
# State passing without CP


def test_pass_states_without_cp_is_zero_and_checks_the_kind():
    metadata = build_packed_metadata([5])
    for dtype, expected in [
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
    ]:
        state = torch.ones(2, 3, 4, dtype=dtype)
        initial = pass_states(state, torch.ones(2, 3, 3, dtype=dtype), metadata, CPTopology.single(), "matrix")
        assert initial.dtype == expected and initial.shape == (2, 3, 4)
        assert torch.all(initial == 0)
    with pytest.raises(ContextParallelError, match="transition kind must be 'matrix' or 'scalar', got 'vector'"):
        pass_states(torch.ones(2, 3, 4), torch.ones(2), metadata, CPTopology.single(), "vector")


# --------------------------------------------------------------------------------------------------------
# Backend selection


def test_resolve_recurrent_backend_on_cpu():
    x = torch.zeros(2, 3)
    assert resolve_recurrent_backend("auto", x) == "torch"
    assert resolve_recurrent_backend("torch", x) == "torch"
    with pytest.raises(ContextParallelError, match="backend 'fla' needs CUDA tensors"):
        resolve_recurrent_backend("fla", x)
    with pytest.raises(ContextParallelError, match="unknown recurrent backend 'triton'"):
        resolve_recurrent_backend("triton", x)
    for op in ("conv", "ssd", "gated_delta", "norm"):
        assert resolve_recurrent_backend("auto", x, op) == "torch"
    with pytest.raises(ContextParallelError, match="backend 'mamba_ssm' needs CUDA tensors and mamba-ssm"):
        resolve_recurrent_backend("mamba_ssm", x, "ssd")
    with pytest.raises(ContextParallelError, match="backend 'mamba_ssm' needs CUDA tensors"):
        resolve_recurrent_backend("mamba_ssm", x, "conv")
    # ops mamba-ssm has no kernel for run as under "auto"
    assert resolve_recurrent_backend("mamba_ssm", x, "gated_delta") == "torch"
    with pytest.raises(ContextParallelError, match="unknown kernel op 'scan'"):
        resolve_recurrent_backend("auto", x, "scan")


@pytest.mark.parametrize(
    ("gpu", "capability", "triton_version", "tilelang", "ssd", "refused"),
    [
        ("NVIDIA H100 80GB HBM3", (9, 0), "3.6.0", False, False, True),
        ("NVIDIA H200", (9, 0), "3.4.0", False, True, True),
        ("NVIDIA GH200 480GB", (9, 0), "3.7.0+git5ab4c8e", False, False, True),  # a Hopper not named "NVIDIA H"
        ("NVIDIA H100 80GB HBM3", (9, 0), "3.7.1", False, True, False),
        ("NVIDIA H100 80GB HBM3", (9, 0), "3.8.0", False, True, False),
        ("NVIDIA H100 80GB HBM3", (9, 0), "3.3.1", False, True, False),
        ("NVIDIA H100 80GB HBM3", (9, 0), "3.6.0", True, False, False),  # fla sends GDN's backward to tilelang
        ("NVIDIA H100 80GB HBM3", (9, 0), "3.6.0", True, True, True),  # but not the SSD's
        ("NVIDIA A100-SXM4-80GB", (8, 0), "3.6.0", False, True, False),
        ("NVIDIA B200", (10, 0), "3.6.0", False, True, False),
    ],
)
def test_fla_backward_problem_names_hopper_with_the_triton_fla_refuses(
    monkeypatch, gpu, capability, triton_version, tilelang, ssd, refused
):
    import importlib.util
    import sys
    import types

    from cp_core import recurrent_backends

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(recurrent_backends, "fla_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__=triton_version))
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: (object() if tilelang else None) if name == "tilelang" else
        real_find_spec(name, *a)
    )  # fmt: skip
    problem = recurrent_backends.fla_backward_problem(0, ssd=ssd)
    if refused:
        assert problem == (
            f"Triton {triton_version} on {gpu} (Hopper): fla's gated backward is wrong with Triton >= 3.4 and < 3.7.1 "
            "and fla refuses it; install triton>=3.7.1 (pip install -U 'triton>=3.7.1')"
        )
    else:
        assert problem is None


def test_fla_backward_problem_is_none_without_cuda_or_fla(monkeypatch):
    from cp_core import recurrent_backends

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(recurrent_backends, "fla_available", lambda: True)
    assert recurrent_backends.fla_backward_problem(0) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(recurrent_backends, "fla_available", lambda: False)
    assert recurrent_backends.fla_backward_problem(0) is None


def test_forcing_fla_on_cpu_raises_in_every_primitive():
    seq_lens = [3, 2]
    conv_x, weight = randn(5, 2, seed=0), randn(2, 3, seed=1)
    with pytest.raises(ContextParallelError, match="'fla' needs CUDA"):
        causal_conv1d(conv_x, weight, seq_lens=seq_lens, backend="fla")
    with pytest.raises(ContextParallelError, match="'fla' needs CUDA"):
        ssd(**ssd_inputs(seq_lens, seed=0), seq_lens=seq_lens, backend="fla")
    with pytest.raises(ContextParallelError, match="'fla' needs CUDA"):
        gated_delta_rule(**gdn_inputs(seq_lens, seed=0), seq_lens=seq_lens, backend="fla")
    with pytest.raises(ContextParallelError, match="unknown recurrent backend"):
        causal_conv1d(conv_x, weight, seq_lens=seq_lens, backend="cuda")
    # "auto" on CPU is the torch path, bit for bit.
    auto, _ = gated_delta_rule(**gdn_inputs(seq_lens, seed=0), seq_lens=seq_lens, backend="auto")
    torch_path, _ = chunk_gated_delta_rule_torch(**gdn_inputs(seq_lens, seed=0), seq_lens=seq_lens)
    assert torch.equal(auto, torch_path)


# --------------------------------------------------------------------------------------------------------
# Input validation


def _replace(inputs: dict, **changes) -> dict:
    return {**inputs, **changes}


def test_gated_delta_input_validation_names_the_bad_shape():
    seq_lens = [3, 2]
    good = gdn_inputs(seq_lens, ratio=2, seed=0)  # q, k [5, 2, 4]; v [5, 4, 3]; g, beta [5, 4]
    cases = [
        (_replace(good, g=torch.zeros(5, 2)), r"g and beta must be \[T, Hv\] = \[5, 4\], got \(5, 2\) and \(5, 4\)"),
        (_replace(good, beta=torch.zeros(5, 4, 1)), r"got \(5, 4\) and \(5, 4, 1\)"),
        (_replace(good, k=torch.zeros(5, 2, 3)), r"k \(5, 2, 3\)"),
        (
            _replace(good, v=torch.zeros(5, 3, 3), g=torch.zeros(5, 3), beta=torch.zeros(5, 3)),
            "value heads 3 must be a multiple of key heads 2",
        ),
        (
            _replace(good, initial_state=torch.zeros(1, 4, 4, 3)),
            r"initial_state must be \[docs, Hv, K, V\] = \[2, 4, 4, 3\], got \(1, 4, 4, 3\)",
        ),
        (_replace(good, initial_state=torch.zeros(2, 4, 3, 4)), r"got \(2, 4, 3, 4\)"),
    ]
    for fn in (naive_recurrent_gated_delta_rule, chunk_gated_delta_rule_torch, gated_delta_rule):
        for inputs, message in cases:
            with pytest.raises(ContextParallelError, match=message):
                fn(**inputs, seq_lens=seq_lens)
        with pytest.raises(ContextParallelError, match="document lengths sum to 6 but there are 5 tokens"):
            fn(**good, seq_lens=[3, 3])
    metadata = build_packed_metadata([4, 2])
    with pytest.raises(ContextParallelError, match="inputs hold 5 tokens but this shard has 6"):
        gated_delta_rule_cp(**good, metadata=metadata, topology=CPTopology.single())
    for segment in (0, 100, -64):
        with pytest.raises(
            ContextParallelError, match=f"prepass_segment_tokens must be a positive multiple of 64 .* got {segment}"
        ):
            gated_delta_rule_cp(**good, metadata=metadata, topology=CPTopology.single(), prepass_segment_tokens=segment)


def test_ssd_input_validation_names_the_bad_shape():
    seq_lens = [3, 2]
    good = ssd_inputs(seq_lens, seed=0)  # x [5, 4, 3]; dt [5, 4]; A [4]; B, C [5, 2, 5]; D [4]
    cases = [
        (_replace(good, dt=torch.ones(5, 3)), r"got \(5, 4, 3\), \(5, 3\), \(4,\)"),
        (_replace(good, A=-torch.ones(2)), r"got \(5, 4, 3\), \(5, 4\), \(2,\)"),
        (_replace(good, B=torch.zeros(5, 3, 5), C=torch.zeros(5, 3, 5)), r"G dividing the 4 heads; got \(5, 3, 5\)"),
        (_replace(good, C=torch.zeros(5, 2, 4)), r"got \(5, 2, 5\), \(5, 2, 4\)"),
        (_replace(good, D=torch.zeros(3)), r"D must be \[H\] = \[4\], got \(3,\)"),
        (
            _replace(good, initial_state=torch.zeros(2, 4, 3, 4)),
            r"initial_state must be \[docs, H, P, N\] = \[2, 4, 3, 5\], got \(2, 4, 3, 4\)",
        ),
    ]
    for fn in (naive_recurrent_ssd, chunk_ssd_torch, ssd):
        for inputs, message in cases:
            with pytest.raises(ContextParallelError, match=message):
                fn(**inputs, seq_lens=seq_lens)
        with pytest.raises(ContextParallelError, match="document lengths sum to 4 but there are 5 tokens"):
            fn(**good, seq_lens=[2, 2])
    metadata = build_packed_metadata([6])
    with pytest.raises(ContextParallelError, match="inputs hold 5 tokens but this shard has 6"):
        ssd_cp(**good, metadata=metadata, topology=CPTopology.single())


def test_conv_input_validation_names_the_bad_shape():
    x, weight = randn(5, 3, seed=0), randn(3, 4, seed=1)
    with pytest.raises(ContextParallelError, match=r"got x \(5, 3\) and weight \(2, 4\)"):
        causal_conv1d(x, randn(2, 4, seed=2), seq_lens=[5])
    with pytest.raises(ContextParallelError, match=r"got x \(5, 3, 1\) and weight \(3, 4\)"):
        naive_causal_conv1d(x[..., None], weight, seq_lens=[5])
    with pytest.raises(ContextParallelError, match=r"bias must be \[D\] = \[3\], got \(4,\)"):
        causal_conv1d(x, weight, torch.zeros(4, dtype=x.dtype), seq_lens=[5])
    with pytest.raises(ContextParallelError, match="activation must be one of"):
        causal_conv1d(x, weight, None, "relu", seq_lens=[5])
    metadata = build_packed_metadata([6])
    with pytest.raises(ContextParallelError, match="x holds 5 tokens but this shard has 6"):
        causal_conv1d_cp(x, weight, None, metadata, CPTopology.single())


def _gdn_rank0_on_fake_group(inputs, total, cp, backend):
    """Rank 0's output and input gradients of ``gated_delta_rule_cp`` on a fake group (one document spanning the
    row): its first document starts here and the fake group's recv leaves the incoming gradient of the passed state
    at zero, so this is rank 0's shard run alone, plus a pre-pass whose gradient contributions are zero."""
    from cp_core.testing import fake_process_group

    metadata = build_packed_metadata([total], 0, cp)
    local = {n: x[: metadata.local_len].detach().clone().requires_grad_() for n, x in inputs.items()}
    with fake_process_group(0, cp) as group:
        out = gated_delta_rule_cp(
            **local, metadata=metadata, topology=CPTopology.from_group(group), qk_l2norm=True, backend=backend
        )
        out.backward(torch.ones_like(out))
    return out, {n: x.grad for n, x in local.items()}


@pytest.mark.parametrize("ratio", [1, 2])
def test_cp_normalizes_q_and_k_once_with_the_same_numbers(ratio):
    """Under CP q and k are normalized before both passes (so the pre-pass reads what the main kernel keeps): rank
    0's output and gradients equal the unsharded run of its shard with the normalization inside. Bitwise with as
    many key as value heads; with value heads sharing a key head the torch path sums the shared heads' gradients
    before the normalization's backward instead of after it (fla's order), a rounding difference."""
    total, cp = 256, 2
    inputs = gdn_inputs([total], ratio=ratio, seed=40, dtype=torch.float32)
    out, grads = _gdn_rank0_on_fake_group(inputs, total, cp, "torch")
    local = {n: x[: total // cp].detach().clone().requires_grad_() for n, x in inputs.items()}
    expected, _ = gated_delta_rule(**local, seq_lens=[total // cp], qk_l2norm=True, backend="torch")
    expected.backward(torch.ones_like(expected))
    assert torch.equal(out, expected)
    for name, grad in grads.items():
        if ratio == 1:
            assert torch.equal(grad, local[name].grad), name
        else:
            torch.testing.assert_close(grad, local[name].grad, rtol=1e-5, atol=1e-6, msg=name)
