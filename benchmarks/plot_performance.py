"""The plots of docs/performance.md, from the recorded benchmark JSON and the planner's closed forms (CPU only).

    uv run --with matplotlib python benchmarks/plot_performance.py                 # all three plots
    uv run --with matplotlib python benchmarks/plot_performance.py --only memory   # one of tokens, memory, bytes

tokens: tokens/s vs row length per shape, ours and transformers, from docs/benchmarks/model_step.json (H200) and,
        for the 0.8B checkpointed line past 32k, the cp = 1 rows of simulated_scale_qwen3_5-0.8b.json.
memory: per-rank peak vs cp (1-64) for the 0.8B shape with checkpointing: measured points where recorded, the planner's
        estimate (sft_trainer.plan.estimate_memory, tested within 15 % of every recorded peak) and the ideal
        (cp = 1 activations / cp + weights and gradients).
bytes:  bytes one rank sends per layer and row vs row length: state passing (GDN, Mamba-2) against the
        all-to-alls (Ulysses attention, Mamba-2 a2a), from the planner's closed forms, which tests keep equal to
        the bytes counted on the collectives.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
sys.path.insert(0, str(Path(__file__).resolve().parent))

GIB = 2**30
MIB = 2**20


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def plot_tokens(out: Path) -> Path:
    plt = _plt()
    rows = json.loads((DOCS / "benchmarks/model_step.json").read_text())["rows"]
    scale = json.loads((DOCS / "benchmarks/simulated_scale_qwen3_5-0.8b.json").read_text())["rows"]
    long_rows = [r for r in scale if r["cp"] == 1 and r.get("timed_step", "").startswith("second")]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    styles = {
        "cp_models": ("C0", "-"),
        "cp_models + act. ckpt": ("C0", "--"),
        "transformers": ("C3", "-"),
        "transformers + grad. ckpt": ("C3", "--"),
    }
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.2 * len(shapes), 3.6), squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=True):
        for variant, (color, line) in styles.items():
            points = sorted(
                (r["seq_len"], r["tokens_per_s"])
                for r in rows
                if r["shape"] == shape and r["variant"] == variant and r.get("status") == "ok"
            )
            if variant == "cp_models + act. ckpt" and shape == "qwen3_5-0.8b":
                points += [(r["seq_len"], r["tokens_per_s_per_gpu"]) for r in long_rows if r["variant"] == variant]
            failed = [
                r
                for r in rows
                if r["shape"] == shape and r["variant"] == variant and r.get("status") != "ok"
                and not r.get("status", "").startswith("superseded")  # measured again: the newer row is plotted
            ]  # fmt: skip
            if points:
                xs, ys = zip(*sorted(points), strict=True)
                ax.plot(xs, ys, line, color=color, marker="o", label=variant)
            for r in failed:
                ax.annotate("OOM" if "OOM" in r["status"] else "x", (r["seq_len"], 0), color=color,
                            textcoords="offset points", xytext=(0, 4 + 10 * ("ckpt" in variant)), ha="center",
                            fontsize=7)  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_title(shape, fontsize=9)
        ax.set_xlabel("tokens per row")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("tokens / s (forward + backward)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("One H200, bf16: tokens/s vs row length (OOM / x at the bottom: did not run)", fontsize=10)
    return _save(fig, out / "tokens_per_s_vs_length.png")


def plot_memory(out: Path) -> Path:
    plt = _plt()
    from model_step import load_shape

    from sft_trainer.plan import estimate_memory

    config = load_shape("qwen3_5-0.8b")
    measured = [
        r
        for r in json.loads((DOCS / "benchmarks/simulated_scale_qwen3_5-0.8b.json").read_text())["rows"]
        if r.get("status") == "ok" and r.get("peak_gib")
    ]
    cps = [1, 2, 4, 8, 16, 32, 64]  # past 8 (the 0.8B's query heads) "auto" gathers K|V, from 32 passes it around
    fig, ax = plt.subplots(figsize=(8.5, 4.2))
    for i, seq_len in enumerate([131072, 262144, 524288, 1048576, 2097152]):
        kw = dict(activation_checkpointing=True, optimizer=False, attention_cp="auto")
        est = [estimate_memory(config, seq_len, cp, **kw) for cp in cps]
        static = (est[0].parameters + est[0].gradients) / GIB
        ideal = [(est[0].total / GIB - static) / cp + static for cp in cps]
        color = f"C{i}"
        ax.plot(cps, [e.total / GIB for e in est], "-o", color=color, label=f"S = {seq_len // 1024}k: planner")
        ax.plot(cps, ideal, ":", color=color, label=f"S = {seq_len // 1024}k: ideal (cp 1 activations / cp)")
        for marker, ring, what in (
            ("s", False, "measured (Ulysses / all-gathered KV)"),
            ("^", True, "measured (ring-passed KV)"),
        ):
            points = {
                (r["cp"], round(r["peak_gib"], 1))
                for r in measured
                if r["seq_len"] == seq_len and (r.get("attention") == "kv_ring") == ring
            }
            if points:
                xs, ys = zip(*sorted(points), strict=True)
                ax.plot(
                    xs,
                    ys,
                    marker,
                    color=color,
                    markersize=9,
                    markerfacecolor="none",
                    label=f"S = {seq_len // 1024}k: {what}",
                )
    ax.axhline(139.8, color="grey", linewidth=0.8)
    ax.text(1, 142, "H200 (139.8 GiB)", fontsize=7, color="grey")
    ax.set_xscale("log", base=2)
    ax.set_xticks(cps, [str(c) for c in cps])
    ax.axvspan(8, 32, color="grey", alpha=0.08)
    ax.axvspan(32, 64, color="grey", alpha=0.16)
    ax.text(9, 200, "all-gathered KV", fontsize=7, color="grey")
    ax.text(33, 200, "ring", fontsize=7, color="grey")
    ax.set_yscale("log", base=2)  # 2M at cp 1 (~280 GiB) and 128k at cp 8 (~5 GiB) on one readable scale
    ax.set_yticks([4, 8, 16, 32, 64, 128, 256], ["4", "8", "16", "32", "64", "128", "256"])
    ax.set_xlabel("cp (ranks)")
    ax.set_ylabel("peak GiB per rank (log scale)")
    ax.set_title("Qwen3.5-0.8B, activation checkpointing, bf16, no optimizer", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.02, 0.5))
    return _save(fig, out / "memory_vs_cp.png")


def plot_bytes(out: Path) -> Path:
    plt = _plt()
    from model_step import load_shape

    from sft_trainer.plan import gdn_bytes, mamba_bytes, ulysses_attention_bytes

    qwen, nano = load_shape("qwen3_5-0.8b"), load_shape("nemotron_h-nano-8l")
    lengths = [8192, 16384, 32768, 65536, 131072, 262144]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), sharey=True)
    for ax, cp in zip(axes, (2, 4, 8), strict=True):
        series = {
            "0.8B attention (Ulysses a2a)": [
                ulysses_attention_bytes(s, cp, qwen.num_attention_heads, qwen.num_key_value_heads, qwen.head_dim)
                for s in lengths
            ],
            "Nano Mamba-2 a2a": [mamba_bytes(nano, "a2a", s, cp) for s in lengths],
            "0.8B GDN state passing": [gdn_bytes(qwen, s, cp) for s in lengths],
            "Nano Mamba-2 state passing": [mamba_bytes(nano, "state_passing", s, cp) for s in lengths],
        }
        for (name, values), style in zip(series.items(), ("-o", "-s", "--o", "--s"), strict=True):
            ax.plot(lengths, [v / MIB for v in values], style, label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"cp = {cp}", fontsize=9)
        ax.set_xlabel("tokens per row")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("MiB one rank sends per layer (fwd + bwd)")
    axes[0].legend(fontsize=7)
    fig.suptitle("Bytes per rank per layer: state passing is flat in S, all-to-all grows with S / cp", fontsize=10)
    return _save(fig, out / "bytes_vs_length.png")


PLOTS = {"tokens": plot_tokens, "memory": plot_memory, "bytes": plot_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=PLOTS, nargs="+", default=list(PLOTS))
    parser.add_argument("--out", type=Path, default=DOCS / "plots")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.only:
        path = PLOTS[name](args.out)
        print(f"wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")


if __name__ == "__main__":
    main()
