"""Ulysses vs all-gathered KV vs ring-passed KV for one softmax-attention layer: bytes each rank sends, what it
holds, how evenly the causal work splits, cp = 2 .. 64.

Bytes are counted by ``cp_core.testing.CommCounter`` on a ``fake`` process group (true shapes, meaningless data), as
in ulysses_bytes.py, and must equal sft_trainer.plan's closed forms. All-gathered KV: the real
``kv_gather_attention`` on 128-token documents at the smallest length (each shard's work is already even, so no rank
swaps queries: the closed form without ``balance``), and for one document spanning the row at every length, with
its exchanges real and its attention arithmetic replaced by a cheap shape-preserving stand-in (rank pairs swap half
their queries: the closed form with ``balance``). Ring-passed KV: the real ``kv_ring_attention`` for one document
spanning the row, its block kernels replaced by shape-preserving stand-ins (the plan, hops and exchanges real). The
work split is exact arithmetic on the packed-row metadata: the
causal scores a rank computes (``cp_core.kv_gather.QueryStretch.causal_scores``); Ulysses gives every rank ``1/cp``
of every document's scores (by heads); all-gathered KV each rank its own queries' scores, or with balancing
(``balanced_stretches``) half of its own and half of its partner's where that evens the work.

Usage:  uv run python benchmarks/attention_cp.py [--seq-lens 32768 131072] [--cps 2 4 8 16 32 64]
Writes the table to docs/benchmarks/attention_cp.md.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from unittest import mock

import torch
from ulysses_bytes import DOC_LEN, SHAPES
from ulysses_bytes import measure as measure_ulysses

from cp_core import (
    CPTopology,
    build_packed_metadata,
    kv_gather_attention,
    kv_ring_attention,
    resolve_attention_cp_style,
)
from cp_core.kv_gather import balanced_stretches, query_stretch
from cp_core.kv_ring import BlockKernels, ring_layout
from cp_core.testing import CommCounter, fake_process_group
from sft_trainer.plan import kv_gather_attention_bytes, kv_ring_attention_bytes, ulysses_attention_bytes

WORK_LAYOUTS = {"one document": None, "8k documents": 8192}


def _stand_in_attention(q, k, v, *args, **kwargs):
    """Shape-preserving and reading every key and value, so that every exchange and its backward still runs."""
    return q + (k.sum(0) + v.sum(0))


def _count_rank0(attend, lens: list[int], seq_len: int, cp: int, hq: int, hkv: int, dim: int, stand_in=None):
    """Bytes rank 0 of a fake group of ``cp`` sends and its number of collectives (each send and receive counted),
    while ``attend`` (q, k, v of zeros, bf16) runs forward + backward over a row of documents ``lens``, with
    ``stand_in`` (a context manager) around it."""
    with fake_process_group(0, cp) as group:
        topology = CPTopology.from_group(group)
        metadata = build_packed_metadata(lens, topology.rank, cp)
        local = seq_len // cp
        q, k, v = (torch.zeros(local, h, dim, dtype=torch.bfloat16, requires_grad=True) for h in (hq, hkv, hkv))
        with CommCounter(cp) as counter, stand_in or contextlib.nullcontext():
            out = attend(q, k, v, metadata, topology, backend="torch")
            out.backward(torch.zeros_like(out))
        return counter.total_sent_bytes, len(counter.records)


def measure_kv_gather(seq_len: int, cp: int, hq: int, hkv: int, dim: int, real: bool) -> tuple[int, int]:
    """Bytes rank 0 sends (the most: it swaps queries where any rank does) and the number of collectives, forward +
    backward. ``real``: 128-token documents, real attention; else one document spanning the row, stand-in
    arithmetic."""
    lens = [DOC_LEN] * (seq_len // DOC_LEN) if real else [seq_len]
    stand_in = None if real else mock.patch("cp_core.kv_gather.varlen_causal_attention", _stand_in_attention)
    return _count_rank0(kv_gather_attention, lens, seq_len, cp, hq, hkv, dim, stand_in)


STAND_IN_BLOCKS = BlockKernels(
    forward=lambda q, k, v, *args: (
        q.new_zeros(q.size(0), q.size(1), v.size(2)),
        q.new_zeros(q.size(1), q.size(0), dtype=torch.float32),
    ),
    backward=lambda dout, q, k, v, *args: (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)),
    on_host=True,
)


def measure_kv_ring(seq_len: int, cp: int, hq: int, hkv: int, dim: int) -> tuple[int, int]:
    """Bytes rank 0 sends and its number of sends and receives, forward + backward, one document spanning the row."""
    stand_in = mock.patch("cp_core.kv_ring.resolve_ring_kernels", lambda *a: STAND_IN_BLOCKS)
    return _count_rank0(kv_ring_attention, [seq_len], seq_len, cp, hq, hkv, dim, stand_in)


def busiest_over_mean(seq_len: int, cp: int, doc_len: int | None, balance: bool) -> float:
    """All-gathered KV: the busiest rank's causal scores over the mean (Ulysses: 1.0 by construction)."""
    lens = [seq_len] if doc_len is None else [doc_len] * (seq_len // doc_len)
    work = []
    for rank in range(cp):
        meta = build_packed_metadata(lens, rank, cp)
        if balance:
            stretches, _ = balanced_stretches(meta)
        else:
            stretches = [query_stretch(meta, meta.shard_start, meta.shard_end)]
        work.append(sum(s.causal_scores() for s in stretches))
    return max(work) / (sum(work) / cp)


def ring_busiest_over_mean(seq_len: int, cp: int, doc_len: int | None) -> tuple[float, int]:
    """Ring-passed KV with its balancing (pairs swap only where the ring gets no longer): the busiest rank's causal
    scores over the mean, and the ring's hops."""
    lens = (seq_len,) if doc_len is None else (doc_len,) * (seq_len // doc_len)
    stretches, _, hops = ring_layout(lens, cp)
    work = [sum(s.causal_scores() for s in mine) for mine in stretches]
    return max(work) / (sum(work) / cp), hops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--cps", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs/benchmarks/attention_cp.md"
    )
    args = parser.parse_args()
    elem, rows = 2, []
    for name, hq, hkv, dim in SHAPES:
        for seq_len in args.seq_lens:
            for cp in args.cps:
                gathered, collectives = measure_kv_gather(seq_len, cp, hq, hkv, dim, real=False)
                if gathered != kv_gather_attention_bytes(seq_len, cp, hq, hkv, dim, elem):
                    raise SystemExit(f"counted {gathered} bytes, the closed form differs ({name}, {seq_len}, {cp})")
                if seq_len == min(args.seq_lens):
                    real, _ = measure_kv_gather(seq_len, cp, hq, hkv, dim, real=True)
                    if real != kv_gather_attention_bytes(seq_len, cp, hq, hkv, dim, elem, balance=False):
                        raise SystemExit(f"kv_gather_attention sent {real}, the closed form without swaps differs")
                ulysses = None
                if resolve_attention_cp_style("auto", hq, hkv, cp) == "ulysses":
                    ulysses, _ = measure_ulysses(seq_len, cp, hq, hkv, dim, torch.bfloat16, full_attention=False)
                    if ulysses != ulysses_attention_bytes(seq_len, cp, hq, hkv, dim, elem):
                        raise SystemExit(f"Ulysses counted {ulysses} bytes, the closed form differs")
                ring, ring_ops = measure_kv_ring(seq_len, cp, hq, hkv, dim)
                if ring != kv_ring_attention_bytes(seq_len, cp, hq, hkv, dim, elem):
                    raise SystemExit(f"kv_ring counted {ring} bytes, the closed form differs ({name}, {seq_len}, {cp})")
                held = seq_len * 2 * hkv * dim * elem  # the gathered k|v buffer, on every rank
                ring_held = 8 * (seq_len // cp) * 2 * hkv * dim * elem  # blocks and gradients in flight, fp32 share
                work = {
                    label: (
                        busiest_over_mean(seq_len, cp, n, False),
                        busiest_over_mean(seq_len, cp, n, True),
                        *ring_busiest_over_mean(seq_len, cp, n),
                    )
                    for label, n in WORK_LAYOUTS.items()
                }
                rows.append(
                    (name, hq, hkv, dim, seq_len, cp, ulysses, gathered, collectives, held, ring, ring_ops, ring_held,
                     work)
                )  # fmt: skip
                print(rows[-1], flush=True)
    lines = [
        "# Softmax attention under CP: Ulysses vs all-gathered vs ring-passed KV, per layer and rank (bf16, forward +",
        "backward)",
        "",
        "Bytes counted by `cp_core.testing.CommCounter` on a `fake` process group, for one document spanning the row",
        "(rank 0; method in benchmarks/attention_cp.py), equal to the closed forms `2 (cp-1) (S/cp) 2 Hkv D b + 4",
        "(S/cp)/2 Hq D b` (the all-gather and reduce-scatter of k|v, then the query / output swap of balancing) and, for",
        "Ulysses where cp divides the heads, `2 (S/cp) (2 Hq + 2 max(Hkv, cp)) D b (cp-1)/cp`; collectives counts each",
        "send and receive of the swaps. held: the gathered row's k|v every rank keeps while the layer runs (Ulysses holds",
        "`S / cp` tokens' q, k, v in head layout instead). busiest / mean: the causal scores of the busiest rank over",
        "the mean under all-gathered KV, each rank attending its own queries | rank pairs swapping half their queries",
        "where that evens the work (the default), for one document spanning the row and for 8k-token documents",
        "(Ulysses: 1.00 by heads). `auto` takes Ulysses wherever it can run; `-` marks a cp that does not divide the",
        "query heads. Ring: the bytes of `kv_ring_attention` (counted, equal to `3 (cp-1) B + B` plus the same swap, `B`",
        "= `(S/cp) 2 Hkv D b` a rank's k|v block: the blocks forward, the blocks and their gradients backward, the",
        "gradients home), its sends and receives, and what it holds instead of the row, whatever S: at most `8 B` in",
        "backward (the block in use and the one arriving, the gradients received, going out and new, the rank's fp32",
        "share). Ring busiest / mean: the ring's balancing, all-gathered KV's where a swap keeps the ring as short as",
        "without swaps (`cp_core.kv_ring.ring_layout`), and its hops.",
        "",
        "Reproduce: `uv run python benchmarks/attention_cp.py`",
        "",
        "| model shape | q / kv heads | S | cp | Ulysses MiB | all-gather KV MiB | collectives | held GiB "
        "| ring MiB | ring sends + receives | ring held GiB "
        + "".join(f"| busiest / mean, {label} | ring busiest / mean (hops), {label} " for label in WORK_LAYOUTS)
        + "|",
        "|---|---|---|---|---|---|---|---|---|---|---|" + "---|---|" * len(WORK_LAYOUTS),
    ]
    for name, hq, hkv, _dim, seq_len, cp, ulysses, gathered, collectives, held, ring, ring_ops, ring_held, work in rows:
        u = "-" if ulysses is None else f"{ulysses / 2**20:.1f}"
        lines.append(
            f"| {name} | {hq} / {hkv} | {seq_len} | {cp} | {u} | {gathered / 2**20:.1f} | {collectives} "
            f"| {held / 2**30:.3f} | {ring / 2**20:.1f} | {ring_ops} | {ring_held / 2**30:.3f} "
            + "".join(
                f"| {work[label][0]:.2f} \\| {work[label][1]:.2f} | {work[label][2]:.2f} ({work[label][3]}) "
                for label in WORK_LAYOUTS
            )
            + "|"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
