"""Two-rank CPU demo: Ulysses CP attention over a packed row vs the unsharded run.

Run with ``uv run cp-demo`` (or ``python -m cp_core.demo --cp 4``). Spawns ``cp`` gloo processes, packs
random documents (some straddling the shard cuts) into one row, and prints the largest difference of the
attention output and of the q/k/v gradients between CP and one process.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from cp_core.packing import PackedRowMetadata
from cp_core.testing import GlooWorkers, check_cp_parity, random_seq_lens
from cp_core.topology import CPTopology
from cp_core.ulysses import ulysses_attention


def attention_case(
    module: None,
    metadata: PackedRowMetadata,
    topology: CPTopology,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> torch.Tensor:
    return ulysses_attention(q, k, v, metadata, topology, backend="torch")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=2, help="context-parallel ranks (gloo processes)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens in the packed row")
    parser.add_argument("--q-heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    seq_lens = random_seq_lens(args.seq_len, random.Random(args.seed), max_docs=6)
    gen = torch.Generator().manual_seed(args.seed)
    q = torch.randn(args.seq_len, args.q_heads, args.head_dim, generator=gen)
    k = torch.randn(args.seq_len, args.kv_heads, args.head_dim, generator=gen)
    v = torch.randn(args.seq_len, args.kv_heads, args.head_dim, generator=gen)
    print(f"packed row: {args.seq_len} tokens, documents {seq_lens}, cp={args.cp}")
    print(f"heads: q={args.q_heads} kv={args.kv_heads} head_dim={args.head_dim}, fp32, gloo on CPU")
    started = time.perf_counter()
    with GlooWorkers(args.cp) as workers:
        report = check_cp_parity(
            workers,
            attention_case,
            seq_lens=seq_lens,
            inputs={"q": q, "k": k, "v": v},
            seq_dims={"q": 0, "k": 0, "v": 0},
        )
    for name in report.relative:
        print(f"  {name:8s} max |CP - unsharded| = {report.absolute[name]:.3e}  (relative {report.relative[name]:.3e})")
    name, worst = report.worst
    print(f"largest relative difference: {worst:.3e} ({name}) in {time.perf_counter() - started:.1f} s")
    report.assert_close(rtol=1e-5)
    print("OK: Ulysses CP attention matches the unsharded run")


if __name__ == "__main__":
    main()
