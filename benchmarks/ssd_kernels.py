"""Which kernel runs Mamba-2's SSD scan on a GPU: mamba-ssm's Triton SSD, fla's chunk_simple_gla, or compiled torch.

    python benchmarks/ssd_kernels.py --out DIR            # one CUDA GPU; writes DIR/ssd_kernels.{md,json}
    uv run python benchmarks/ssd_kernels.py --device cpu --tiny   # CPU smoke run of the code path

One Nemotron-H Nano Mamba-2 layer's scan (64 heads x 64, 8 B/C groups, state 128), bf16 inputs, packed documents
(3 per row), forward + backward with a random output gradient. Candidates:

- ``mamba-ssm``: ``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined``, if it imports (the package's
  ``__init__`` imports its CUDA extension, so a build without CUDA does not import at all);
- ``fla``: ``cp_core.ssd.ssd(backend="fla")`` (``chunk_simple_gla`` with q = C, k = B, v = dt x, g = dt A);
- ``torch``: ``cp_core.ssd.chunk_ssd_torch`` eager, and under ``torch.compile`` (compile time reported; only at the
  shorter length, since its per-chunk loop unrolls into the graph).

Error columns: relative L2 distance of the output and of the x gradient from the fp32 torch path on the same inputs.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from cp_core.ssd import chunk_ssd_torch, ssd
from cp_core.testing import relative_l2

NANO = dict(heads=64, head_dim=64, groups=8, state=128)
TINY = dict(heads=4, head_dim=8, groups=2, state=8)


def make_inputs(seq_len: int, shape: dict, device: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    h, p, g, n = shape["heads"], shape["head_dim"], shape["groups"], shape["state"]
    return {
        "x": torch.randn(seq_len, h, p, device=device),
        "dt": F.softplus(torch.randn(seq_len, h, device=device) - 2),
        "A": -torch.rand(h, device=device).add(0.5),
        "B": torch.randn(seq_len, g, n, device=device) / n**0.5,
        "C": torch.randn(seq_len, g, n, device=device) / n**0.5,
    }


def doc_lens(seq_len: int) -> list[int]:
    first, second = seq_len // 2, seq_len // 3
    return [first, second, seq_len - first - second]


def mamba_ssm_scan():
    """mamba-ssm's SSD as ``fn(x, dt, A, B, C, lens) -> y``, or the import error as a string."""
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception as exc:  # ImportError, or the CUDA extension missing behind it
        return f"{type(exc).__name__}: {exc}"

    def run(x, dt, A, B, C, lens):
        seq_idx = torch.repeat_interleave(torch.arange(len(lens), device=x.device), torch.tensor(lens, device=x.device))
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=x.device, dtype=torch.int32)
        y = mamba_chunk_scan_combined(
            x[None], dt[None], A, B[None], C[None], chunk_size=128, seq_idx=seq_idx[None].int(), cu_seqlens=cu
        )
        return y[0] if not isinstance(y, tuple) else y[0][0]

    return run


def _scan(fn, lens, x, dt, A, B, C):
    return fn(x, dt, A, B, C, seq_lens=lens)[0]


def _mamba(fn, lens, x, dt, A, B, C):
    return fn(x, dt, A, B, C, lens)


def timed(fn, inputs: dict[str, torch.Tensor], reps: int, device: str) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Median ms of forward + backward, and the last output and x gradient."""
    cuda = device.startswith("cuda")
    leaves = {k: v.detach().clone().requires_grad_(k == "x") for k, v in inputs.items()}
    grad = None
    times = [0.0]
    warmup = 2 if reps else 0
    for i in range(reps + warmup or 1):
        leaves["x"].grad = None
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn(**leaves)
        if grad is None:
            grad = torch.randn(out.shape, device=out.device, generator=torch.Generator(out.device).manual_seed(1))
        out.float().backward(grad)
        if cuda:
            torch.cuda.synchronize()
        if reps and i >= warmup:
            times.append((time.perf_counter() - start) * 1000)
    times = times[1:] or times
    return sorted(times)[len(times) // 2], out.detach().float(), leaves["x"].grad.float()


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
    mamba = mamba_ssm_scan()
    compiled = torch.compile(chunk_ssd_torch)
    rows = []
    for seq_len in seq_lens:
        base = make_inputs(seq_len, shape, args.device)
        lens = doc_lens(seq_len)
        eager = functools.partial(_scan, chunk_ssd_torch, lens)
        _, ref_y, ref_dx = timed(eager, base, 0, args.device)
        bf16 = {k: (v.bfloat16() if k in ("x", "B", "C") else v) for k, v in base.items()}
        candidates = {"torch (eager)": eager}
        if seq_len <= args.compile_max_len:
            candidates["torch (compiled)"] = functools.partial(_scan, compiled, lens)
        if args.device.startswith("cuda"):
            candidates["fla chunk_simple_gla"] = functools.partial(_scan, functools.partial(ssd, backend="fla"), lens)
            if callable(mamba):
                candidates["mamba-ssm Triton SSD"] = functools.partial(_mamba, mamba, lens)
        for name, fn in candidates.items():
            started = time.perf_counter()
            try:
                ms, y, dx = timed(fn, bf16, args.reps, args.device)
            except Exception as exc:  # report a kernel that fails instead of losing the whole table
                rows.append(dict(kernel=name, seq_len=seq_len, error=f"{type(exc).__name__}: {exc}"[:300]))
                print(rows[-1], flush=True)
                continue
            total_s = time.perf_counter() - started
            row = dict(
                kernel=name,
                seq_len=seq_len,
                ms=ms,
                first_call_s=total_s - ms * (args.reps + 2) / 1000,
                y_err=relative_l2(y, ref_y),
                dx_err=relative_l2(dx, ref_dx),
            )
            rows.append(row)
            print(row, flush=True)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
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
    mamba_note = "imports" if callable(mamba) else f"does not import here: `{mamba}`"
    lines += ["", f"mamba-ssm: {mamba_note}."]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ssd_kernels.md").write_text("\n".join(lines) + "\n")
    (args.out / "ssd_kernels.json").write_text(json.dumps({"device": device, "mamba_ssm": mamba_note, "rows": rows}))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
