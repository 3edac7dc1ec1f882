"""Bytes each rank sends per attention layer under Ulysses CP, counted from the tensors actually exchanged.

Runs one rank's share of Ulysses attention forward + backward on a ``fake`` process group (true shapes,
meaningless data: only the shapes of what is exchanged matter here) under ``cp_core.testing.CommCounter``.
At the smallest length the real ``ulysses_attention`` runs; at every length the same exchange pipeline
(``qkv_sequence_to_heads`` -> attention -> ``heads_to_sequence``) runs with a shape-preserving stand-in for the
attention arithmetic, which is irrelevant to the bytes and slow on a CPU at 128k tokens. Both counts must equal
the closed form

    per layer, forward + backward = 2 * (S / cp) * (2 Hq + 2 Hkv') * D * bytes * (cp - 1) / cp,
    Hkv' = max(Hkv, cp)  (KV heads replicated up to cp)

Usage:  uv run python benchmarks/ulysses_bytes.py [--seq-lens 8192 32768 131072] [--cps 2 4 8]
Writes the table to docs/benchmarks/ulysses_bytes.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from cp_core import CPTopology, build_packed_metadata, heads_to_sequence, qkv_sequence_to_heads, ulysses_attention
from cp_core.testing import CommCounter, fake_process_group

# (name, q heads, kv heads, head dim) of the full-attention layers of public Qwen3.5 / Nemotron-H configs.
SHAPES = [
    ("Qwen3.5-0.8B", 8, 2, 256),
    ("Qwen3.5-9B", 16, 4, 256),
    ("Qwen3.5-35B-A3B", 16, 2, 256),
    ("Nemotron-H-Nano-30B", 32, 2, 128),
]
DOC_LEN = 128  # short documents keep the (irrelevant) CPU attention cheap; bytes do not depend on them


def closed_form(seq_len: int, cp: int, hq: int, hkv: int, dim: int, elem: int) -> int:
    return 2 * (seq_len // cp) * (2 * hq + 2 * max(hkv, cp)) * dim * elem * (cp - 1) // cp


def exchange_pipeline(q, k, v, metadata, topology):
    """What ulysses_attention exchanges, with a cheap stand-in that keeps shapes and the autograd graph."""
    qh, kh, vh = qkv_sequence_to_heads(q, k, v, topology)
    group = qh.size(1) // kh.size(1)
    out = qh + (kh + vh).repeat_interleave(group, dim=1)
    return heads_to_sequence(out, topology)


def measure(
    seq_len: int, cp: int, hq: int, hkv: int, dim: int, dtype: torch.dtype, full_attention: bool
) -> tuple[int, int]:
    with fake_process_group(0, cp) as group:
        topology = CPTopology.from_group(group)
        metadata = build_packed_metadata([DOC_LEN] * (seq_len // DOC_LEN), topology.rank, cp)
        local = seq_len // cp
        q = torch.zeros(local, hq, dim, dtype=dtype, requires_grad=True)
        k = torch.zeros(local, hkv, dim, dtype=dtype, requires_grad=True)
        v = torch.zeros(local, hkv, dim, dtype=dtype, requires_grad=True)
        with CommCounter(cp) as counter:
            if full_attention:
                out = ulysses_attention(q, k, v, metadata, topology, backend="torch")
            else:
                out = exchange_pipeline(q, k, v, metadata, topology)
            out.backward(torch.zeros_like(out))
        return counter.total_sent_bytes, len(counter.records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--cps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs/benchmarks/ulysses_bytes.md"
    )
    args = parser.parse_args()
    dtype, elem = torch.bfloat16, 2
    rows = []
    for name, hq, hkv, dim in SHAPES:
        for seq_len in args.seq_lens:
            for cp in args.cps:
                if hq % cp or (hkv % cp and cp % hkv):
                    continue
                sent, collectives = measure(seq_len, cp, hq, hkv, dim, dtype, full_attention=False)
                expected = closed_form(seq_len, cp, hq, hkv, dim, elem)
                if seq_len == min(args.seq_lens):
                    real = measure(seq_len, cp, hq, hkv, dim, dtype, full_attention=True)
                    if real != (sent, collectives):
                        raise SystemExit(f"ulysses_attention exchanged {real}, the pipeline {(sent, collectives)}")
                if sent != expected:
                    raise SystemExit(
                        f"counted {sent} bytes but the closed form says {expected} ({name}, {seq_len}, {cp})"
                    )
                rows.append((name, hq, hkv, dim, seq_len, cp, collectives, sent))
                print(
                    f"{name:22s} S={seq_len:7d} cp={cp}: {sent / 2**20:10.1f} MiB sent per rank ({collectives} all-to-alls)"
                )
    lines = [
        "# Ulysses attention: bytes sent per rank per layer (forward + backward, bf16)",
        "",
        "Counted by `cp_core.testing.CommCounter` from the tensors handed to the collectives while one rank runs",
        "Ulysses attention forward and backward on a `fake` process group (the real `ulysses_attention` at the",
        "smallest length, its exchange pipeline with a stand-in for the attention arithmetic at every length; the",
        "two counts agree). Every row equals the closed form",
        "`2 (S/cp) (2 Hq + 2 max(Hkv, cp)) D bytes (cp-1)/cp`. q, k and v travel in one fused all-to-all.",
        "",
        "Reproduce: `uv run python benchmarks/ulysses_bytes.py`",
        "",
        "| model shape | q heads | kv heads | head dim | S | cp | all-to-alls | MiB sent per rank |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, hq, hkv, dim, seq_len, cp, collectives, sent in rows:
        lines.append(f"| {name} | {hq} | {hkv} | {dim} | {seq_len} | {cp} | {collectives} | {sent / 2**20:.1f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
