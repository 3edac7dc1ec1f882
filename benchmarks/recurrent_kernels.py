"""Which kernel runs each recurrent op of the hybrid models on a GPU: the table behind ``recurrent_backend="auto"``.

    python benchmarks/recurrent_kernels.py --out DIR      # one CUDA GPU; writes DIR/recurrent_kernels.{md,json}
    uv run python benchmarks/recurrent_kernels.py --device cpu --tiny --seq-lens 256   # CPU smoke run

Ops, at Nemotron-H Nano widths, bf16 inputs, forward + backward with a random output gradient, rows of
S tokens in 3 documents on this rank (the recurrence restarts at each):

- ``ssd``: one Mamba-2 layer's scan (64 heads x 64, 8 B/C groups, state 128) through ``cp_core.ssd.ssd``, whose
  finals (every document's last state, with gradients) are what CP passes on; kernels ``torch`` (chunked, eager),
  ``fla`` (chunk_simple_gla) and ``mamba_ssm`` (mamba-ssm's Triton SSD);
- ``conv``: the depthwise causal conv (10240 channels, width 4) as ``cp_core.conv.causal_conv1d_cp`` runs it on a
  rank whose first document began on the previous rank (the CP halo enters as the conv's initial state);
  kernels ``torch`` (shift-and-add), ``fla`` and ``mamba_ssm`` (causal-conv1d's CUDA kernel).

Error columns: relative L2 distance of the output and of the input gradient from the torch path in fp32 on the
same inputs.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from cp_core.conv import _kernel_conv
from cp_core.packing import build_packed_metadata
from cp_core.recurrent_backends import fla_available, mamba_ssm_available
from cp_core.ssd import ssd
from cp_core.testing import relative_l2

NANO = dict(heads=64, head_dim=64, groups=8, state=128, channels=10240, width=4)
TINY = dict(heads=4, head_dim=8, groups=2, state=8, channels=16, width=4)


def doc_lens(seq_len: int) -> list[int]:
    first, second = seq_len // 2, seq_len // 3
    return [first, second, seq_len - first - second]


def ssd_case(seq_len: int, shape: dict, device: str):
    gen = torch.Generator(device).manual_seed(0)
    h, p, g, n = shape["heads"], shape["head_dim"], shape["groups"], shape["state"]
    inputs = {
        "x": torch.randn(seq_len, h, p, device=device, generator=gen),
        "dt": F.softplus(torch.randn(seq_len, h, device=device, generator=gen) - 2),
        "A": -torch.rand(h, device=device, generator=gen).add(0.5),
        "B": torch.randn(seq_len, g, n, device=device, generator=gen) / n**0.5,
        "C": torch.randn(seq_len, g, n, device=device, generator=gen) / n**0.5,
    }
    lens = doc_lens(seq_len)

    def run(kernel, v):
        y, finals = ssd(v["x"], v["dt"], v["A"], v["B"], v["C"], seq_lens=lens, backend=kernel)
        return torch.cat([y.flatten(), finals.flatten()])

    return inputs, ("x", "B", "C"), run


def conv_case(seq_len: int, shape: dict, device: str):
    gen = torch.Generator(device).manual_seed(1)
    d, w = shape["channels"], shape["width"]
    # rank 1 of 2 holding S tokens of a 2S row; its first document began on rank 0, so the halo is live
    quarter = seq_len // 4
    meta = build_packed_metadata([seq_len + quarter, 2 * quarter, seq_len - 3 * quarter], cp_rank=1, cp_size=2)
    inputs = {
        "x": torch.randn(meta.local_len, d, device=device, generator=gen),
        "w": torch.randn(d, w, device=device, generator=gen) * 0.5,
        "b": torch.randn(d, device=device, generator=gen),
        "halo": torch.randn(w - 1, d, device=device, generator=gen),
    }

    def run(kernel, v):  # what causal_conv1d_cp runs once the halo has come from the previous rank
        return _kernel_conv(kernel, v["x"], v["w"], v["b"], "silu", meta.local_seq_lens, v["halo"],
                            meta.first_doc_tokens_before, meta.local_position_ids.to(device))  # fmt: skip

    return inputs, ("x", "w", "b", "halo"), run


def timed(fn, leaves: dict[str, torch.Tensor], reps: int, cuda: bool):
    """Median ms of forward + backward; the last output and the first leaf's gradient."""
    times, grad, out = [0.0], None, None
    warmups = 2 if reps else 0
    for i in range(reps + warmups or 1):
        for t in leaves.values():
            t.grad = None
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn(leaves)
        if grad is None:
            grad = torch.randn(out.shape, device=out.device, generator=torch.Generator(out.device).manual_seed(2))
        out.float().backward(grad)
        if cuda:
            torch.cuda.synchronize()
        if reps and i >= warmups:
            times.append((time.perf_counter() - start) * 1000)
    times = times[1:] or times
    first = next(iter(leaves.values()))
    return sorted(times)[len(times) // 2], out.detach().float(), first.grad.float()


CASES = {"ssd": ssd_case, "conv": conv_case}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--ops", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--torch-max-len", type=int, default=32768, help="time the torch path up to this length")
    args = parser.parse_args()
    shape = TINY if args.tiny else NANO
    cuda = args.device.startswith("cuda")
    kernels = ["torch"]
    if cuda and fla_available():
        kernels.append("fla")
    if cuda and mamba_ssm_available():
        kernels.append("mamba_ssm")
    rows = []

    def write():
        lines = table(rows, torch.cuda.get_device_name() if cuda else "CPU", args)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "recurrent_kernels.md").write_text("\n".join(lines) + "\n")
        (args.out / "recurrent_kernels.json").write_text(json.dumps({"kernels": kernels, "rows": rows}, indent=1))

    for op in args.ops:
        for seq_len in args.seq_lens:
            inputs, low, run = CASES[op](seq_len, shape, args.device)
            ref_leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
            _, ref_out, ref_grad = timed(functools.partial(run, "torch"), ref_leaves, 0, cuda)
            bf16 = {k: (v.bfloat16() if k in low else v) for k, v in inputs.items()}
            for kernel in kernels:
                if kernel == "torch" and seq_len > args.torch_max_len:
                    continue
                leaves = {k: v.clone().requires_grad_() for k, v in bf16.items()}
                started = time.perf_counter()
                try:  # a kernel that fails (out of memory included, in the error columns too) gets its line
                    ms, out, grad = timed(functools.partial(run, kernel), leaves, args.reps, cuda)
                    first_call_s = time.perf_counter() - started - ms * (args.reps + 2) / 1000
                    row = dict(op=op, kernel=kernel, seq_len=seq_len, ms=ms, first_call_s=first_call_s,
                               out_err=relative_l2(out, ref_out), grad_err=relative_l2(grad, ref_grad))  # fmt: skip
                except Exception as exc:
                    row = dict(op=op, kernel=kernel, seq_len=seq_len, error=f"{type(exc).__name__}: {exc}"[:300])
                rows.append(row)
                print(row, flush=True)
                write()
                del leaves
                out = grad = None
                if cuda:
                    torch.cuda.empty_cache()
            del inputs, ref_leaves, ref_out, ref_grad
            if cuda:
                torch.cuda.empty_cache()
    write()
    print((args.out / "recurrent_kernels.md").read_text())


def table(rows: list[dict], device: str, args) -> list[str]:
    lines = [
        f"# Recurrent kernels on {device} (bf16, Nemotron-H Nano widths)",
        "",
        f"Forward + backward, median of {args.reps} after 2 warm-ups; rows of S tokens in 3 documents; errors vs "
        "the torch path in fp32 on the same inputs (output; first input's gradient).",
        "",
        "Command: `python benchmarks/recurrent_kernels.py` ("
        + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items()
            if k in ("seq_lens", "reps")
        )
        + ")",
        "",
        "| op | S | kernel | ms fwd+bwd | first call s | out rel err | grad rel err |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["op"], r["seq_len"], r.get("ms", 1e12))):
        if "error" in r:
            lines.append(f"| {r['op']} | {r['seq_len']} | {r['kernel']} | failed: {r['error']} | | | |")
        else:
            lines.append(f"| {r['op']} | {r['seq_len']} | {r['kernel']} | {r['ms']:.2f} | {r['first_call_s']:.1f} "
                         f"| {r['out_err']:.2e} | {r['grad_err']:.2e} |")  # fmt: skip
    return lines


if __name__ == "__main__":
    main()
