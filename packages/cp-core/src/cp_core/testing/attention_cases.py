"""Attention parity cases on the torch backend: one case per KV strategy, layouts swept, styles compared."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from cp_core.attention_styles import context_parallel_attention
from cp_core.kv_gather import kv_gather_attention
from cp_core.kv_ring import kv_ring_attention
from cp_core.packing import PackedRowMetadata, build_packed_metadata
from cp_core.testing.parity import ParityCase, check_cp_parity
from cp_core.testing.workers import GlooWorkers
from cp_core.topology import CPTopology


def kv_attention_case(
    module: None,
    metadata: PackedRowMetadata,
    topology: CPTopology,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    ring: bool = False,
    scale: float | None = None,
    sliding_window: int | None = None,
    balance: bool = True,
    strided: bool = False,
) -> torch.Tensor:
    """A parity case (:func:`check_cp_parity`): all-gathered KV, or ring-passed KV with ``ring``, on the torch
    backend. ``strided``: q with the same values, dense but not contiguous (what a rank sends must still be)."""
    if strided:
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
        assert not q.is_contiguous()
    attend = kv_ring_attention if ring else kv_gather_attention
    return attend(
        q, k, v, metadata, topology, scale=scale, sliding_window=sliding_window, backend="torch", balance=balance
    )  # fmt: skip


def attention_style_difference(
    topology: CPTopology, seq_lens: Sequence[int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, styles
) -> float:
    """On this rank (a :class:`GlooWorkers` function): the largest difference between the outputs of two attention
    CP styles (``styles``, e.g. ``("kv_ring", "kv_gather")``) for the row's ``q``, ``k``, ``v``, torch backend."""
    meta = build_packed_metadata(seq_lens, topology.rank, topology.size)
    local = [t[meta.shard_start : meta.shard_end] for t in (q, k, v)]
    a, b = (context_parallel_attention(*local, meta, topology, style, backend="torch") for style in styles)
    return (a - b).abs().max().item()


def attention_parity_failures(
    workers: GlooWorkers,
    case: ParityCase,
    layouts: Mapping[str, Sequence[int]],
    *,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    v_dim: int | None = None,
    rtol: float = 1e-5,
) -> list[str]:
    """``case`` (attention over ``q`` [S, Hq, D], ``k`` [S, Hkv, D], ``v`` [S, Hkv, Dv]) sharded over ``workers``
    against the unsharded run, row by row of ``layouts``, on fp32 inputs seeded by the layout's index and the head
    counts; one line per layout whose output or any input gradient differs by more than ``rtol`` (or is missing)."""
    failures = []
    for index, (layout, seq_lens) in enumerate(layouts.items()):
        seed, total = 100 * index + q_heads + kv_heads, sum(seq_lens)
        shapes = {"q": (q_heads, head_dim), "k": (kv_heads, head_dim), "v": (kv_heads, v_dim or head_dim)}
        inputs = {
            name: torch.randn((total, *shape), generator=torch.Generator().manual_seed(seed + offset))
            for offset, (name, shape) in enumerate(shapes.items())
        }
        report = check_cp_parity(
            workers, case, seq_lens=seq_lens, inputs=inputs, seq_dims={"q": 0, "k": 0, "v": 0}, seed=seed
        )
        if set(report.relative) != {"out", "grad.q", "grad.k", "grad.v"}:
            failures.append(f"{layout} {list(seq_lens)}: compared only {sorted(report.relative)}")
            continue
        try:
            report.assert_close(rtol=rtol)
        except AssertionError as exc:
            failures.append(f"{layout} {list(seq_lens)}: {exc}")
    return failures
