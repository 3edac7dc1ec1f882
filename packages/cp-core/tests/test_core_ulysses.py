"""Ulysses attention: the varlen reference against dense masked attention, the all-to-all layouts, and
sharded vs unsharded parity on real gloo groups of 2 and 4 ranks over every layout case."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from cp_core import (
    ContextParallelError,
    CPTopology,
    build_packed_metadata,
    check_ulysses_heads,
    heads_to_sequence,
    qkv_sequence_to_heads,
    replicate_kv_heads,
    resolve_attention_backend,
    sequence_to_heads,
    shard_sequence,
    ulysses_attention,
    varlen_causal_attention,
)
from cp_core.packing import PackedRowMetadata
from cp_core.testing import (
    GlooWorkers,
    attention_parity_failures,
    check_cp_parity,
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


# --------------------------------------------------------------------------------------------------------
# The torch reference backend against dense attention written out by hand


def dense_attention(q, k, v, seq_lens, scale=None, sliding_window=None):
    """Full [T, T] attention in float64 with a block-diagonal causal (optionally windowed) mask."""
    tokens, q_heads, dim = q.shape
    group = q_heads // k.size(1)
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    doc = torch.tensor([d for d, n in enumerate(seq_lens) for _ in range(n)])
    i = torch.arange(tokens)[:, None]
    j = torch.arange(tokens)[None, :]
    mask = (doc[:, None] == doc[None, :]) & (j <= i)
    if sliding_window is not None:
        mask &= i - j < sliding_window  # itself and the W - 1 tokens before it
    scores = torch.einsum("ihd,jhd->hij", q.double(), k) * (dim**-0.5 if scale is None else scale)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return torch.einsum("hij,jhd->ihd", probs, v)


@pytest.mark.parametrize(("q_heads", "kv_heads"), [(4, 4), (8, 2), (6, 3), (4, 1)])
@pytest.mark.parametrize("sliding_window", [None, 1, 2, 5, 1000])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_torch_varlen_attention_matches_dense(q_heads, kv_heads, sliding_window, scale):
    rng = random.Random(q_heads * 100 + kv_heads)
    for trial in range(3):
        seq_lens = [1, 2, 9, 1, 14, 3] if trial == 0 else random_seq_lens(48, rng, max_docs=8)
        total = sum(seq_lens)
        seed = 10 * trial + q_heads
        q = randn(total, q_heads, HEAD_DIM, seed=seed).requires_grad_()
        k = randn(total, kv_heads, HEAD_DIM, seed=seed + 1).requires_grad_()
        v = randn(total, kv_heads, HEAD_DIM + 3, seed=seed + 2).requires_grad_()
        cu = build_packed_metadata(seq_lens).cu_seqlens
        out = torch_varlen_attention(q, k, v, cu, scale=scale, sliding_window=sliding_window)
        grad_out = randn(*out.shape, seed=seed + 3)
        got_grads = torch.autograd.grad(out, (q, k, v), grad_out)
        want = dense_attention(q, k, v, seq_lens, scale=scale, sliding_window=sliding_window)
        want_grads = torch.autograd.grad(want, (q, k, v), grad_out.double())
        assert out.shape == (total, q_heads, HEAD_DIM + 3) and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
        for got, expected in zip(got_grads, want_grads, strict=True):  # q, k, v
            torch.testing.assert_close(got.double(), expected.double(), rtol=1e-5, atol=1e-5)
        # The dispatching entry point picks the same reference on CPU fp32.
        for backend in ("torch", "auto"):
            again = varlen_causal_attention(
                q, k, v, cu, max(seq_lens), scale=scale, sliding_window=sliding_window, backend=backend
            )
            assert torch.equal(again, out)


def test_sliding_window_semantics():
    seq_lens = [6, 4]
    q = randn(10, 2, HEAD_DIM, seed=0)
    k = randn(10, 2, HEAD_DIM, seed=1)
    v = randn(10, 2, HEAD_DIM, seed=2)
    cu = build_packed_metadata(seq_lens).cu_seqlens
    # W = 1: every token sees only itself, so the output is its own value.
    assert torch.allclose(torch_varlen_attention(q, k, v, cu, sliding_window=1), v, atol=1e-6)
    # The first token of every document sees only itself, whatever the window.
    for window in (None, 2, 3):
        out = torch_varlen_attention(q, k, v, cu, sliding_window=window)
        assert torch.allclose(out[[0, 6]], v[[0, 6]], atol=1e-6)
    # W = 2 at token 7 (second of document 2): an exact two-way softmax over tokens 6 and 7.
    out = torch_varlen_attention(q, k, v, cu, sliding_window=2)
    weights = torch.softmax(torch.einsum("hd,jhd->hj", q[7], k[6:8]) * HEAD_DIM**-0.5, dim=-1)
    torch.testing.assert_close(out[7], torch.einsum("hj,jhd->hd", weights, v[6:8]), rtol=1e-5, atol=1e-6)
    # A window as long as the document changes nothing; a shorter one does.
    full = torch_varlen_attention(q, k, v, cu)
    assert torch.allclose(torch_varlen_attention(q, k, v, cu, sliding_window=6), full, atol=1e-6)
    assert not torch.allclose(torch_varlen_attention(q, k, v, cu, sliding_window=3)[:6], full[:6], atol=1e-3)
    with pytest.raises(ContextParallelError, match="sliding_window must be >= 1 or None, got 0"):
        varlen_causal_attention(q, k, v, cu, 6, sliding_window=0, backend="torch")


def test_varlen_input_checks():
    q, k = torch.zeros(8, 4, 8), torch.zeros(8, 3, 8)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ContextParallelError, match="query heads 4 must be a multiple of key/value heads 3"):
        varlen_causal_attention(q, k, k, cu, 8, backend="torch")
    with pytest.raises(ContextParallelError, match=r"must be \[tokens, heads, head_dim\]"):
        varlen_causal_attention(q[0], k, k, cu, 8, backend="torch")
    with pytest.raises(ContextParallelError, match="tokens must agree"):
        varlen_causal_attention(q, k[:7], k[:7], cu, 8, backend="torch")
    with pytest.raises(ContextParallelError, match="cu_seqlens must be 1-D with at least 2 entries"):
        varlen_causal_attention(q, q, q, cu[:1], 8, backend="torch")


# --------------------------------------------------------------------------------------------------------
# Backends, head rules, KV replication (single process)


def test_resolve_attention_backend_on_cpu():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        q = torch.zeros(4, 2, 8, dtype=dtype)
        assert resolve_attention_backend("auto", q) == "torch"
        assert resolve_attention_backend("torch", q) == "torch"
        for forced in ("varlen", "flash_attn"):
            with pytest.raises(ContextParallelError, match=f"attention backend '{forced}' needs CUDA fp16/bf16"):
                resolve_attention_backend(forced, q)
    q = torch.zeros(4, 2, 8)
    for bad in ("flash", "sdpa", "", "TORCH"):
        with pytest.raises(ContextParallelError, match=f"unknown attention backend {bad!r}"):
            resolve_attention_backend(bad, q)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ContextParallelError, match="'varlen' needs CUDA"):
        varlen_causal_attention(q, q, q, cu, 4, backend="varlen")


@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "cp", "error"),
    [
        (8, 8, 1, None),
        (3, 3, 1, None),  # no CP: nothing to split
        (8, 8, 2, None),
        (8, 2, 2, None),
        (8, 1, 2, None),
        (8, 4, 4, None),
        (8, 2, 4, None),
        (8, 1, 4, None),
        (16, 8, 4, None),
        (16, 2, 8, None),
        (6, 3, 2, "cp=2, kv_heads=3"),
        (12, 6, 4, "cp=4, kv_heads=6"),
        (24, 6, 4, "cp=4, kv_heads=6"),
        (24, 3, 8, "cp=8, kv_heads=3"),
        (6, 6, 4, r"cp=4, q_heads=6; choose cp in \[1, 2, 3, 6\]"),
        (3, 1, 2, r"cp=2, q_heads=3; choose cp in \[1, 3\]"),
        (8, 3, 2, "q_heads=8 is not a multiple of kv_heads=3"),
    ],
)
def test_check_ulysses_heads(q_heads, kv_heads, cp, error):
    if error is None:
        check_ulysses_heads(q_heads, kv_heads, cp)
    else:
        with pytest.raises(ContextParallelError, match=error):
            check_ulysses_heads(q_heads, kv_heads, cp)


def test_replicate_kv_heads_values_and_backward():
    x = randn(5, 2, 3, seed=0).requires_grad_()
    out = replicate_kv_heads(x, 8)
    assert out.shape == (5, 8, 3)
    for head in range(8):
        assert torch.equal(out[:, head], x[:, head // 4])  # each head repeated cp / kv_heads times, in order
    upstream = randn(5, 8, 3, seed=1)
    out.backward(upstream)
    assert torch.allclose(x.grad[:, 0], upstream[:, 0:4].sum(1), atol=1e-6)
    assert torch.allclose(x.grad[:, 1], upstream[:, 4:8].sum(1), atol=1e-6)
    for cp in (1, 2):  # kv_heads >= cp: no replication
        assert replicate_kv_heads(x, cp) is x


def test_ulysses_without_cp_is_plain_varlen_attention():
    seq_lens = [5, 11, 3, 5]
    meta = build_packed_metadata(seq_lens)
    q, k, v = randn(24, 4, 8, seed=0), randn(24, 2, 8, seed=1), randn(24, 2, 8, seed=2)
    out = ulysses_attention(q, k, v, meta, CPTopology.single(), backend="torch", sliding_window=3)
    assert torch.equal(out, torch_varlen_attention(q, k, v, meta.cu_seqlens, sliding_window=3))
    with pytest.raises(ContextParallelError, match="metadata was built for rank 1 of cp=2"):
        ulysses_attention(q[:12], k[:12], v[:12], build_packed_metadata(seq_lens, 1, 2), CPTopology.single())
    with pytest.raises(ContextParallelError, match=r"local tokens=24.*got \(23, 4, 8\)"):
        ulysses_attention(q[:23], k, v, meta, CPTopology.single())


# --------------------------------------------------------------------------------------------------------
# Worker-side helpers (module level: the workers import them by name)


def upstream_grad(shape: tuple[int, ...], rank: int, seed: int) -> torch.Tensor:
    return randn(*shape, seed=1000 * seed + rank)


def _all_to_all_layouts(topology: CPTopology, x_full: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    x = shard_sequence(x_full, topology, 0).clone().requires_grad_()
    heads = sequence_to_heads(x, topology)
    back = heads_to_sequence(heads, topology)
    heads.backward(upstream_grad(tuple(heads.shape), topology.rank, seed))
    return {"heads": heads.detach(), "back": back.detach(), "grad": x.grad}


def _bad_head_split(topology: CPTopology) -> str:
    try:
        sequence_to_heads(torch.zeros(4, topology.size + 1, 2), topology)
    except ContextParallelError as exc:
        return str(exc)
    return "no error"


def _fused_vs_separate(
    topology: CPTopology, q_full: torch.Tensor, k_full: torch.Tensor, v_full: torch.Tensor, seed: int
) -> dict[str, torch.Tensor]:
    results = {}
    for path in ("fused", "separate"):
        q, k, v = (shard_sequence(t, topology, 0).clone().requires_grad_() for t in (q_full, k_full, v_full))
        if path == "fused":
            qh, kh, vh = qkv_sequence_to_heads(q, k, v, topology)
        else:
            qh = sequence_to_heads(q, topology)
            kh = sequence_to_heads(replicate_kv_heads(k, topology.size), topology)
            vh = sequence_to_heads(replicate_kv_heads(v, topology.size), topology)
        loss = sum(
            (t * upstream_grad(tuple(t.shape), topology.rank, seed + i)).sum() for i, t in enumerate((qh, kh, vh))
        )
        loss.backward()
        for name, tensor in (("qh", qh), ("kh", kh), ("vh", vh), ("gq", q.grad), ("gk", k.grad), ("gv", v.grad)):
            results[f"{path}.{name}"] = tensor.detach()
    return results


def _attention_case(
    module: None,
    metadata: PackedRowMetadata,
    topology: CPTopology,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    return ulysses_attention(q, k, v, metadata, topology, scale=scale, sliding_window=sliding_window, backend="torch")


def _no_exchange_case(
    module: None, metadata: PackedRowMetadata, topology: CPTopology, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """Deliberately wrong CP: attention over the local shard only, blind to earlier ranks."""
    return varlen_causal_attention(q, k, v, metadata.local_cu_seqlens, metadata.local_max_seqlen, backend="torch")


# --------------------------------------------------------------------------------------------------------
# Multi-process


CP_SIZES = (2, 4)


@pytest.fixture(scope="module")
def workers(request):
    """One pool per CP size for the whole module (tests pick the size by indirect parametrization)."""
    with GlooWorkers(request.param) as pool:
        yield pool


with_workers = pytest.mark.parametrize("workers", CP_SIZES, indirect=True, ids=lambda cp: f"cp{cp}")


@with_workers
@pytest.mark.parametrize("heads", [4, 8])
def test_sequence_to_heads_layout_and_round_trip(workers, heads):
    cp = workers.world_size
    seq, local = 4 * cp, 4
    x_full = randn(seq, heads, 3, seed=heads)
    results = workers.run(_all_to_all_layouts, x_full, heads)
    per_rank = heads // cp
    # The adjoint: rank r's tokens get, for head h, the upstream gradient of the rank owning h.
    grad_full = torch.cat([upstream_grad((seq, per_rank, 3), rank, heads) for rank in range(cp)], dim=1)  # [S, H, D]
    for rank, result in enumerate(results):
        assert result["heads"].shape == (seq, per_rank, 3)
        assert torch.equal(result["heads"], x_full[:, rank * per_rank : (rank + 1) * per_rank]), rank
        assert torch.equal(result["back"], x_full[rank * local : (rank + 1) * local]), rank
        assert torch.equal(result["grad"], grad_full[rank * local : (rank + 1) * local]), rank
    for message in workers.run(_bad_head_split):
        assert message == f"cannot split {cp + 1} heads over cp={cp} ranks"


def _kv_configs(cp: int) -> list[tuple[int, int]]:
    return [(8, 1), (8, 2), (8, cp), (8, 8), (16, 8)] if cp == 4 else [(4, 1), (4, 2), (8, 4), (8, 8)]


@with_workers
def test_qkv_sequence_to_heads_matches_separate_exchanges(workers):
    cp = workers.world_size
    seq = 4 * cp
    for q_heads, kv_heads in _kv_configs(cp):
        for v_dim in (HEAD_DIM, HEAD_DIM + 2):  # same head dim: one fused all-to-all; different: three
            seed = q_heads * 10 + kv_heads + v_dim
            q_full = randn(seq, q_heads, HEAD_DIM, seed=seed)
            k_full = randn(seq, kv_heads, HEAD_DIM, seed=seed + 1)
            v_full = randn(seq, kv_heads, v_dim, seed=seed + 2)
            results = workers.run(_fused_vs_separate, q_full, k_full, v_full, seed)
            k_rep, v_rep = replicate_kv_heads(k_full, cp), replicate_kv_heads(v_full, cp)
            hq, hk = q_heads // cp, k_rep.size(1) // cp
            for rank, result in enumerate(results):
                context = f"q={q_heads} kv={kv_heads} v_dim={v_dim} rank={rank}"
                for name in ("qh", "kh", "vh", "gq", "gk", "gv"):
                    assert torch.equal(result[f"fused.{name}"], result[f"separate.{name}"]), f"{context}: {name}"
                assert torch.equal(result["fused.qh"], q_full[:, rank * hq : (rank + 1) * hq]), context
                assert torch.equal(result["fused.kh"], k_rep[:, rank * hk : (rank + 1) * hk]), context
                assert torch.equal(result["fused.vh"], v_rep[:, rank * hk : (rank + 1) * hk]), context
                # Query heads of rank r read KV head (global q head) // (q_heads // kv_heads) under GQA.
                group = q_heads // kv_heads
                for local_q in range(hq):
                    kv_index = (rank * hq + local_q) // group
                    local_kv = local_q // (hq // hk)
                    assert torch.equal(result["fused.kh"][:, local_kv], k_full[:, kv_index]), context


def _parity_configs(cp: int) -> dict[str, dict]:
    """Head configurations by role, the same names for every cp (kv heads below, equal to and above cp)."""
    return {
        "kv1": {"q_heads": 8, "kv_heads": 1},  # below cp: replicated cp times
        "kv2": {"q_heads": 8, "kv_heads": 2},  # below cp=4, equal to cp=2
        "kv_eq_cp": {"q_heads": 2 * cp, "kv_heads": cp},
        "kv8": {"q_heads": 8, "kv_heads": 8},  # above cp, no GQA
        "q16_kv8": {"q_heads": 16, "kv_heads": 8},  # above cp, GQA groups of 2
        "window5": {"q_heads": 8, "kv_heads": 2, "sliding_window": 5},
        "scale": {"q_heads": 8, "kv_heads": cp, "scale": 0.37},
        "v_dim": {"q_heads": 4, "kv_heads": 1, "v_dim": HEAD_DIM + 4},  # v head dim differs: unfused exchange
    }


@with_workers
@pytest.mark.parametrize("config_name", list(_parity_configs(2)))
def test_ulysses_parity_over_layout_cases(workers, config_name):
    cp = workers.world_size
    config = _parity_configs(cp)[config_name]
    check_ulysses_heads(config["q_heads"], config["kv_heads"], cp)
    q_heads, kv_heads = config["q_heads"], config["kv_heads"]
    case = functools.partial(_attention_case, scale=config.get("scale"), sliding_window=config.get("sliding_window"))
    layouts = layout_cases(TOTAL, cp)
    assert len(layouts) == 6
    failures = attention_parity_failures(
        workers, case, layouts, q_heads=q_heads, kv_heads=kv_heads, head_dim=HEAD_DIM, v_dim=config.get("v_dim")
    )
    assert not failures, f"cp={cp} {config_name}:\n" + "\n".join(failures)


@with_workers
def test_parity_harness_catches_missing_exchange(workers):
    """Attention that ignores the other ranks agrees with nothing once documents cross the cuts."""
    cp = workers.world_size
    inputs = {"q": randn(TOTAL, 4, HEAD_DIM, seed=1), "k": randn(TOTAL, 2, HEAD_DIM, seed=2)}
    inputs["v"] = randn(TOTAL, 2, HEAD_DIM, seed=3)
    seq_dims = {"q": 0, "k": 0, "v": 0}
    layouts = layout_cases(TOTAL, cp)
    for layout in ("single_document", "spans_all_ranks", "cuts_inside_documents"):
        report = check_cp_parity(workers, _no_exchange_case, seq_lens=layouts[layout], inputs=inputs, seq_dims=seq_dims)
        assert report.relative["out"] > 1e-2, (layout, str(report))
        with pytest.raises(AssertionError, match="CP differs from the unsharded run"):
            report.assert_close(rtol=1e-5)
    # With every cut on a document boundary the shards are independent, and local attention is exact.
    seq_lens = [TOTAL // cp] * cp
    report = check_cp_parity(workers, _no_exchange_case, seq_lens=seq_lens, inputs=inputs, seq_dims=seq_dims)
    report.assert_close(rtol=1e-5)
