"""Time of one softmax-attention layer's local work per rank, forward + backward, Ulysses vs all-gathered KV (GPU).

One rank of a ``fake`` process group of cp ranks (its collectives return at once: compute only, no communication)
runs the real ``ulysses_attention`` / ``kv_gather_attention`` on one document spanning the row, bf16, for the
Qwen3.5-0.8B / 2B attention shape (8 query heads, 2 KV heads, head dim 256). Variants:

- ``ulysses``: every rank attends the whole row with Hq / cp heads (where cp divides the heads);
- ``kv_gather``: the library's default, balanced: rank r attends the first half of its queries and the second half
  of rank cp - 1 - r's (the fake group swaps garbage of the right shape), one kernel call per query head;
- ``kv_gather, own queries``: ``balance=False``, rank r's S / cp queries against every earlier key;
- ``kv_gather, own queries, one GQA call``: the same work in one call over all query heads, to price the per-head
  launches (one query head per call avoids flash-attn 2's [keys, Hq, D] dk/dv expansion under GQA).

Ranks: the middle one (cp // 2) and the last (cp - 1, the busiest when ranks keep their own queries: its queries
see the whole row, about 2x the mean, 1.98x at cp 64).

Usage (GPU machine): python benchmarks/attention_cp_time.py [--seq-lens 131072 1048576] [--cps 8 16 64]
Writes the table to docs/benchmarks/attention_cp_time.md (--out).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from cp_core import (
    CPTopology,
    build_packed_metadata,
    gather_kv,
    kv_gather_attention,
    resolve_attention_cp_style,
    ulysses_attention,
    varlen_causal_attention,
)
from cp_core.kv_gather import key_range
from cp_core.testing import fake_process_group

HQ, HKV, DIM = 8, 2, 256


def _one_gqa_call(q, k, v, metadata, topology):
    """The own-queries work in one kernel call over all query heads (the comparison, not the library path)."""
    start, end = key_range(metadata)
    keys, values = gather_kv(k, v, topology, start, end)
    before = metadata.shard_start - start
    cu_q = metadata.local_cu_seqlens.to(device=q.device, dtype=torch.int32)
    cu_k = cu_q + torch.cat([cu_q.new_zeros(1), cu_q.new_full((cu_q.numel() - 1,), before)])
    return varlen_causal_attention(
        q, torch.cat(keys, 1), torch.cat(values, 1), cu_q, metadata.local_max_seqlen, cu_seqlens_k=cu_k,
        max_seqlen_k=max(metadata.local_max_seqlen, metadata.local_seq_lens[0] + before),
    )  # fmt: skip


VARIANTS = {
    "ulysses": lambda q, k, v, m, t: ulysses_attention(q, k, v, m, t),
    "kv_gather": lambda q, k, v, m, t: kv_gather_attention(q, k, v, m, t),
    "kv_gather, own queries": lambda q, k, v, m, t: kv_gather_attention(q, k, v, m, t, balance=False),
    "kv_gather, own queries, one GQA call": _one_gqa_call,
}


def time_variant(variant: str, seq_len: int, cp: int, rank: int, reps: int, device: str = "cuda") -> dict:
    """Best-of-``reps`` milliseconds of forward + backward (after one warm-up call) and, on CUDA, the peak
    allocated above the inputs."""
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with fake_process_group(rank, cp) as group:
        topology = CPTopology.from_group(group)
        metadata = build_packed_metadata([seq_len], topology.rank, cp)
        local = seq_len // cp
        q, k, v = (
            torch.randn(local, h, DIM, device=device, dtype=torch.bfloat16, requires_grad=True) for h in (HQ, HKV, HKV)
        )
        grad = torch.randn(local, HQ, DIM, device=device, dtype=torch.bfloat16)
        base = torch.cuda.memory_allocated() if cuda else 0
        times = []
        for i in range(reps + 1):
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            VARIANTS[variant](q, k, v, metadata, topology).backward(grad)
            if cuda:
                torch.cuda.synchronize()
            if i:  # the first call pays launch-time setup
                times.append((time.perf_counter() - started) * 1e3)
            q.grad = k.grad = v.grad = None
        extra = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else float("nan")
        return dict(ms=min(times), peak_extra_gib=extra)


def write_table(rows: list[dict], args, device_name: str) -> str:
    """The table so far, written to ``args.out`` (after every row, so a run cut short keeps what it timed)."""
    lines = [
        f"# One attention layer's local work per rank under CP, forward + backward ({device_name})",
        "",
        f"Qwen3.5-0.8B / 2B attention shape ({HQ} query heads, {HKV} KV heads, head dim {DIM}), bf16, one document",
        "spanning the row; one rank of a `fake` process group (compute only: the collectives return at once).",
        f"Best of {args.reps} timed call(s) after a warm-up call; extra GiB: peak allocated above q, k, v during the",
        "calls. Method and variants in benchmarks/attention_cp_time.py.",
        "",
        "Reproduce on the GPU machine: `python benchmarks/attention_cp_time.py "
        f"--seq-lens {' '.join(map(str, args.seq_lens))} --cps {' '.join(map(str, args.cps))}`",
        "",
        "| S | cp | rank | variant | ms | extra GiB |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['seq_len']} | {r['cp']} | {r['rank']} | {r['variant']} | {r['ms']:.1f} | {r['peak_extra_gib']:.2f} |"
        for r in rows
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[131072, 1048576])
    parser.add_argument("--cps", type=int, nargs="+", default=[8, 16, 64])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs/benchmarks/attention_cp_time.md"
    )
    args = parser.parse_args()
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    rows = []
    for seq_len in args.seq_lens:
        for cp in args.cps:
            ranks = {"middle": cp // 2, "last": cp - 1} if cp > 2 else {"last": 1}
            for rank_name, rank in ranks.items():
                for variant in VARIANTS:
                    if variant == "ulysses" and (
                        rank != cp // 2 or resolve_attention_cp_style("auto", HQ, HKV, cp) != "ulysses"
                    ):
                        continue  # every Ulysses rank does the same work
                    result = time_variant(variant, seq_len, cp, rank, args.reps, args.device)
                    rows.append(dict(seq_len=seq_len, cp=cp, rank=f"{rank} ({rank_name})", variant=variant, **result))
                    print(rows[-1], flush=True)
                    write_table(rows, args, device_name)

    print(write_table(rows, args, device_name))


if __name__ == "__main__":
    main()
