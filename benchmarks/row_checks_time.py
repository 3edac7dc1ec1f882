"""Time of the per-row input checks a cp_models forward runs before its first layer, on one GPU.

    python benchmarks/row_checks_time.py --out DIR                  # CUDA, one rank of a fake cp = 8 group
    uv run python benchmarks/row_checks_time.py --device cpu --out /tmp/x   # CPU smoke run

Each forward checks its row once: the local checks (shapes, integer token ids inside the vocabulary, integer labels:
one host sync for both bounds), then the all-reduce that makes every rank stop together when one rank's inputs are
wrong (:func:`cp_core.check_same_row_on_every_rank`: three int64 and one host sync), then the row's metadata. Both
syncs wait for the GPU work queued before them; in sft-train the previous step already ended with a sync (the
logged loss and gradient norm), so what a forward pays is what is timed here: the checks from an idle queue. The
fake group's all-reduce returns at once, so a real group adds one NCCL all-reduce of 24 bytes (a few tens of
microseconds on NVLink).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from cp_core import CPTopology
from cp_core.testing import fake_process_group
from cp_models.row_inputs import build_row_metadata, validated_row_inputs

VOCAB = 248_320  # Qwen3.5's vocabulary


def time_checks(seq_len: int, cp: int, docs: int, device: str, reps: int) -> dict:
    """Median wall time of one row's checks and metadata for rank cp // 2 of a fake group of cp ranks."""
    local = seq_len // cp
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, VOCAB, (1, local), generator=generator).to(device)
    labels = torch.randint(0, VOCAB, (1, local), generator=generator).to(device)
    seq_lens = torch.full((docs,), seq_len // docs, dtype=torch.int32)
    seq_lens[-1] += seq_len - int(seq_lens.sum())

    times = []
    with fake_process_group(cp // 2, cp) as group:
        topology = CPTopology.from_group(group) if group is not None else CPTopology.single()
        for _ in range(reps + 3):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            tokens, problem = validated_row_inputs(input_ids, None, None, labels, vocab_size=VOCAB)
            build_row_metadata(seq_lens, tokens, topology, device, inputs=(input_ids, labels), problem=problem)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    return dict(seq_len=seq_len, cp=cp, docs=docs, local_tokens=local, us=1e6 * statistics.median(times[3:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--cp", type=int, default=8)
    parser.add_argument("--docs", type=int, default=16, help="documents per row")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = parser.parse_args()
    rows = [time_checks(s, args.cp, args.docs, args.device, args.reps) for s in args.seq_lens]
    lines = [
        f"Per-row checks of a cp_models forward, rank {args.cp // 2} of a fake cp = {args.cp} group, "
        f"{args.docs} documents, median of {args.reps} ({args.device}, idle queue)",
        "",
        "| S | tokens per rank | checks + metadata, us |",
        "|---|---|---|",
        *(f"| {r['seq_len']} | {r['local_tokens']} | {r['us']:.0f} |" for r in rows),
    ]
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "row_checks_time.md").write_text(text)
    (args.out / "row_checks_time.json").write_text(json.dumps(rows, indent=1))
    print(text)


if __name__ == "__main__":
    main()
