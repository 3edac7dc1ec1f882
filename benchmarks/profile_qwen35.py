"""Where the time of one forward + backward goes: torch.profiler tables of ours vs transformers (Qwen3.5-0.8B shape).

    python benchmarks/profile_qwen35.py [--seq-len 8192] [--out DIR]

Same model shape and step as benchmarks/model_step.py (shape qwen3_5-0.8b). Writes to --out, per model:
profile_<model>.txt (operators by self CUDA time), profile_<model>_host.txt (by self CPU time), python_<model>.txt
and .cumulative.txt (one more step under cProfile: the Python functions issuing the work); and a summary of CUDA
time by kernel family, which it prints. fla reads the tuned kernel configs shipped for the GPU (cp_core.fla_tuning).
"""

from __future__ import annotations

import argparse
import gc
import re
from collections import defaultdict
from pathlib import Path

import torch
from model_step import build, load_shape
from torch.profiler import ProfilerActivity, profile

from cp_core.fla_tuning import use_fla_tuning

FAMILIES = [  # first match wins
    ("gdn (fla)", r"chunk|fwd_h|bwd_dh|wy|kkt|solve_tril|recompute|prepare_wy|gated_delta|l2norm|cumsum|local_cumsum"),
    ("conv (fla)", r"conv"),
    ("attention", r"flash|attn|fmha|sdpa"),
    ("matmul", r"gemm|cutlass|sm90|nvjet|cublas|matmul|xmma"),
    ("loss / softmax", r"log_softmax|logsumexp|softmax|cross_entropy|nll|tile_stats|tile_grad"),
    ("copy / cast", r"copy|cast|to_copy|cat|fill"),
    ("reduce", r"reduce"),
    ("elementwise", r"elementwise|vectorized|unrolled|triton_"),
]


def family(name: str) -> str:
    low = name.lower()
    for label, pattern in FAMILIES:
        if re.search(pattern, low):
            return label
    return "other"


def profile_step(model, step, vocab_size: int, seq_len: int):
    ids = torch.randint(0, vocab_size, (seq_len,), device="cuda")
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        step(ids)
    torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(ids)
        torch.cuda.synchronize()
    return prof


def python_profile(model, step, vocab_size: int, seq_len: int, out: Path) -> None:
    """The host side of one (warm) step under cProfile: where Python spends the time that issues the kernels."""
    import cProfile
    import io
    import pstats

    ids = torch.randint(0, vocab_size, (seq_len,), device="cuda")
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    step(ids)
    profiler.disable()
    torch.cuda.synchronize()
    for order, path in (("tottime", out), ("cumulative", out.with_suffix(".cumulative.txt"))):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(60)
        path.write_text(text.getvalue())


def summarize(prof) -> dict[str, float]:
    by_family: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            by_family[family(event.key)] += event.self_device_time_total / 1000
    return dict(by_family)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=Path("/tmp/profile"))
    parser.add_argument("--variants", nargs="+", choices=("ours", "transformers"), default=["ours", "transformers"])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    use_fla_tuning(torch.device("cuda"))
    config = load_shape("qwen3_5-0.8b")
    summaries = {}
    for name, variant in (("ours", "cp_models"), ("transformers", "transformers")):
        if name not in args.variants:
            continue
        model, step = build(variant, config, "cuda")
        prof = profile_step(model, step, config.vocab_size, args.seq_len)
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=45, max_name_column_width=90)
        (args.out / f"profile_{name}.txt").write_text(table)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=45, max_name_column_width=90)
        (args.out / f"profile_{name}_host.txt").write_text(table)
        python_profile(model, step, config.vocab_size, args.seq_len, args.out / f"python_{name}.txt")
        summaries[name] = summarize(prof)
        del model, step, prof
        gc.collect()
        torch.cuda.empty_cache()
    names = list(summaries)  # the variants that ran, in order
    first = summaries[names[0]]
    families = sorted({f for s in summaries.values() for f in s}, key=lambda f: -first.get(f, 0))
    lines = [
        f"CUDA ms by kernel family, one forward + backward at S = {args.seq_len}",
        "",
        "| family | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for f in families:
        lines.append(f"| {f} | " + " | ".join(f"{summaries[n].get(f, 0):.1f}" for n in names) + " |")
    lines.append("| total | " + " | ".join(f"{sum(summaries[n].values()):.1f}" for n in names) + " |")
    (args.out / "profile_summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
