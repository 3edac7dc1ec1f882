"""Ulysses vs all-gathered KV for one softmax-attention layer: bytes each rank sends, what it holds, how evenly the
causal work splits, cp = 2 .. 64.

Bytes are counted by ``cp_core.testing.CommCounter`` on a ``fake`` process group (true shapes, meaningless data), as
in ulysses_bytes.py: the real ``kv_gather_attention`` / ``ulysses_attention`` at the smallest length, their exchange
pipelines with a shape-preserving stand-in for the attention arithmetic at every length (the two counts must agree,
and equal sft_trainer.plan's closed forms). The work split is exact arithmetic on the packed-row metadata: the
causal scores a rank computes, sum over its documents of ``q_len (keys before + (q_len + 1) / 2)``; Ulysses gives
every rank ``1/cp`` of every document's scores (by heads), all-gathered KV gives each rank its own queries' scores.

Usage:  uv run python benchmarks/attention_cp.py [--seq-lens 32768 131072] [--cps 2 4 8 16 32 64]
Writes the table to docs/benchmarks/attention_cp.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from ulysses_bytes import DOC_LEN, SHAPES
from ulysses_bytes import measure as measure_ulysses

from cp_core import CPTopology, build_packed_metadata, gather_kv, kv_gather_attention, resolve_attention_cp_style
from cp_core.kv_gather import key_range
from cp_core.testing import CommCounter, fake_process_group
from sft_trainer.plan import kv_gather_attention_bytes, ulysses_attention_bytes

WORK_LAYOUTS = {"one document": None, "8k documents": 8192}


def measure_kv_gather(seq_len: int, cp: int, hq: int, hkv: int, dim: int, real: bool) -> tuple[int, int]:
    """Bytes rank 0 sends (every rank sends the same) and the number of collectives, forward + backward."""
    with fake_process_group(0, cp) as group:
        topology = CPTopology.from_group(group)
        metadata = build_packed_metadata([DOC_LEN] * (seq_len // DOC_LEN), topology.rank, cp)
        local = seq_len // cp
        q = torch.zeros(local, hq, dim, dtype=torch.bfloat16, requires_grad=True)
        k = torch.zeros(local, hkv, dim, dtype=torch.bfloat16, requires_grad=True)
        v = torch.zeros(local, hkv, dim, dtype=torch.bfloat16, requires_grad=True)
        with CommCounter(cp) as counter:
            if real:
                out = kv_gather_attention(q, k, v, metadata, topology, backend="torch")
            else:  # the gather and its reduce-scatter, with a stand-in that reads every gathered row
                keys, values = gather_kv(k, v, topology)
                out = q + (torch.cat(keys, 1) + torch.cat(values, 1)).sum(0).repeat_interleave(hq // hkv, dim=0)
            out.backward(torch.zeros_like(out))
        return counter.total_sent_bytes, len(counter.records)


def causal_scores(q_len: int, keys_before: int) -> float:
    return q_len * (keys_before + (q_len + 1) / 2)


def busiest_over_mean(seq_len: int, cp: int, doc_len: int | None) -> float:
    """All-gathered KV: the busiest rank's causal scores over the mean (Ulysses: 1.0 by construction)."""
    lens = [seq_len] if doc_len is None else [doc_len] * (seq_len // doc_len)
    work = []
    for rank in range(cp):
        meta = build_packed_metadata(lens, rank, cp)
        before = meta.shard_start - key_range(meta)[0]
        pieces = [(n, before if i == 0 else 0) for i, n in enumerate(meta.local_seq_lens)]
        work.append(sum(causal_scores(n, b) for n, b in pieces))
    return max(work) / (sum(work) / cp)


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
                if seq_len == min(args.seq_lens):
                    real = measure_kv_gather(seq_len, cp, hq, hkv, dim, real=True)
                    if real != (gathered, collectives):
                        raise SystemExit(f"kv_gather_attention sent {real}, the pipeline {(gathered, collectives)}")
                if gathered != kv_gather_attention_bytes(seq_len, cp, hkv, dim, elem):
                    raise SystemExit(f"counted {gathered} bytes, the closed form differs ({name}, {seq_len}, {cp})")
                ulysses = None
                if resolve_attention_cp_style("auto", hq, hkv, cp) == "ulysses":
                    ulysses, _ = measure_ulysses(seq_len, cp, hq, hkv, dim, torch.bfloat16, full_attention=False)
                    if ulysses != ulysses_attention_bytes(seq_len, cp, hq, hkv, dim, elem):
                        raise SystemExit(f"Ulysses counted {ulysses} bytes, the closed form differs")
                held = seq_len * 2 * hkv * dim * elem  # the gathered k|v buffer, on every rank
                work = {label: busiest_over_mean(seq_len, cp, n) for label, n in WORK_LAYOUTS.items()}
                rows.append((name, hq, hkv, dim, seq_len, cp, ulysses, gathered, collectives, held, work))
                print(rows[-1], flush=True)
    lines = [
        "# Softmax attention under CP: Ulysses vs all-gathered KV, per layer and rank (bf16, forward + backward)",
        "",
        "Bytes counted by `cp_core.testing.CommCounter` on a `fake` process group (the real `kv_gather_attention` at",
        "the smallest length, its all-gather / reduce-scatter pipeline at every length; equal to the closed forms",
        "`2 (cp-1) (S/cp) 2 Hkv D b` and, for Ulysses where cp divides the heads, `2 (S/cp) (2 Hq + 2 max(Hkv, cp)) D b",
        "(cp-1)/cp`). held: the gathered row's k|v every rank keeps while the layer runs (Ulysses holds `S / cp` tokens'",
        "q, k, v in head layout instead). busiest / mean: the causal scores of the busiest rank over the mean under",
        "all-gathered KV, for one document spanning the row and for 8k-token documents (Ulysses: 1.00 by heads).",
        "`auto` takes Ulysses wherever it can run; `-` marks a cp that does not divide the query heads.",
        "",
        "Reproduce: `uv run python benchmarks/attention_cp.py`",
        "",
        "| model shape | q / kv heads | S | cp | Ulysses MiB | all-gather KV MiB | collectives | held GiB "
        + "".join(f"| busiest / mean, {label} " for label in WORK_LAYOUTS)
        + "|",
        "|---|---|---|---|---|---|---|---|" + "---|" * len(WORK_LAYOUTS),
    ]
    for name, hq, hkv, _dim, seq_len, cp, ulysses, gathered, collectives, held, work in rows:
        u = "-" if ulysses is None else f"{ulysses / 2**20:.1f}"
        lines.append(
            f"| {name} | {hq} / {hkv} | {seq_len} | {cp} | {u} | {gathered / 2**20:.1f} | {collectives} "
            f"| {held / 2**30:.3f} " + "".join(f"| {work[label]:.2f} " for label in WORK_LAYOUTS) + "|"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
