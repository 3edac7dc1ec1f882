"""Whether compiling the torch SSD path could stand in for a kernel: ``torch.compile`` of ``chunk_ssd_torch``
against eager torch and fla's ``chunk_simple_gla``.

    python benchmarks/ssd_kernels.py --out DIR            # one CUDA GPU; writes DIR/ssd_kernels.{md,json}
    uv run python benchmarks/ssd_kernels.py --device cpu --tiny   # CPU smoke run of the code path

One Nemotron-H Nano Mamba-2 layer's scan (64 heads x 64, 8 B/C groups, state 128), bf16 inputs, packed documents
(3 per row), forward + backward with a random output gradient. The compile time is reported, and compiled torch
runs only at the shorter length (its per-chunk loop unrolls into the graph). The kernels' comparison with
mamba-ssm at 8k-128k is ``recurrent_kernels.py``, whose inputs, document split and timing this script shares.

Error columns: relative L2 distance of the output and of the x gradient from the fp32 torch path on the same inputs.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import torch
from recurrent_kernels import NANO, TINY, doc_lens, ssd_case, timed

from cp_core.ssd import chunk_ssd_torch, ssd
from cp_core.testing import relative_l2


def _scan(fn, lens: list[int], leaves: dict[str, torch.Tensor]) -> torch.Tensor:
    return fn(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], seq_lens=lens)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=None, help="default 2048 32768 (256 with --tiny)")
    parser.add_argument("--compile-max-len", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    shape = TINY if args.tiny else NANO
    seq_lens = args.seq_lens or ([256] if args.tiny else [2048, 32768])
    cuda = args.device.startswith("cuda")
    compiled = torch.compile(chunk_ssd_torch)
    rows = []
    for seq_len in seq_lens:
        base, _, _ = ssd_case(seq_len, shape, args.device)
        lens = doc_lens(seq_len)
        eager = functools.partial(_scan, chunk_ssd_torch, lens)
        ref = {k: v.clone().requires_grad_(k == "x") for k, v in base.items()}
        _, ref_y, ref_dx = timed(eager, ref, 0, cuda)
        bf16 = {k: (v.bfloat16() if k in ("x", "B", "C") else v) for k, v in base.items()}
        candidates = {"torch (eager)": eager}
        if seq_len <= args.compile_max_len:
            candidates["torch (compiled)"] = functools.partial(_scan, compiled, lens)
        if cuda:
            candidates["fla chunk_simple_gla"] = functools.partial(_scan, functools.partial(ssd, backend="fla"), lens)
        for name, fn in candidates.items():
            leaves = {k: v.clone().requires_grad_(k == "x") for k, v in bf16.items()}
            started = time.perf_counter()
            try:  # a kernel that fails gets its line instead of losing the table
                ms, y, dx = timed(fn, leaves, args.reps, cuda)
                row = dict(kernel=name, seq_len=seq_len, ms=ms,
                           first_call_s=time.perf_counter() - started - ms * (args.reps + 2) / 1000,
                           y_err=relative_l2(y, ref_y), dx_err=relative_l2(dx, ref_dx))  # fmt: skip
            except Exception as exc:
                row = dict(kernel=name, seq_len=seq_len, error=f"{type(exc).__name__}: {exc}"[:300])
            rows.append(row)
            print(row, flush=True)
    device = torch.cuda.get_device_name() if cuda else "CPU"
    lines = [
        f"# Mamba-2 SSD scan kernels on {device} (bf16, Nemotron-H Nano layer widths)" if not args.tiny else "# tiny",
        "",
        "Forward + backward of one layer's scan, 3 packed documents, median of "
        f"{args.reps} after 2 warm-ups; errors vs the fp32 torch path. Reproduce: `python benchmarks/ssd_kernels.py`.",
        "",
        "| kernel | S | ms fwd+bwd | first call s (compile) | y rel err | dx rel err |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['kernel']} | {r['seq_len']} | failed: {r['error']} | | | |")
        else:
            lines.append(
                f"| {r['kernel']} | {r['seq_len']} | {r['ms']:.2f} | {r['first_call_s']:.1f} | {r['y_err']:.2e} "
                f"| {r['dx_err']:.2e} |"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ssd_kernels.md").write_text("\n".join(lines) + "\n")
    (args.out / "ssd_kernels.json").write_text(json.dumps({"device": device, "rows": rows}))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
