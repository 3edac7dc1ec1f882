"""Tables of the `sft-train` GPU runs that benchmarks/gpu_train.sh makes (its runs-*.tgz unpacked into one folder):

    python benchmarks/sft_train_runs.py --runs docs/benchmarks/sft_train_gpu --out docs/benchmarks/sft_train_gpu.md

Per run: the first step (compilation and autotuning included), the median step after the first two, tokens/s as
the trainer prints it (row tokens, padding included, over the step's wall time), peak GPU memory, first and last
loss. Then the trainer against ``model_step.py`` (forward + backward alone) for the same shape, row and options,
checkpoint + resume against the uninterrupted run, and the HF export's logits against transformers.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

# trainer run -> (folder of the model_step.py run made in the same call, its shape, variant and S): the same work
# (one 0.8B row, bf16, no FSDP)
SAME_WORK = {
    "r08_8k": ("step", "qwen3_5-0.8b", "cp_models", 8192),
    "r08_8k_ac": ("step_ac", "qwen3_5-0.8b", "cp_models + act. ckpt", 8192),
    "r08_32k": ("step32", "qwen3_5-0.8b", "cp_models", 32768),
    "r08_32k_ac": ("step32", "qwen3_5-0.8b", "cp_models + act. ckpt", 32768),
}


def read_run(folder: Path) -> dict | None:
    log, metrics = folder / "log.txt", folder / "metrics.jsonl"
    if not log.is_file():
        return None
    head = log.read_text().splitlines()[0]
    match = re.match(r"== (\S+): (\S+), S=(\d+), (\d+) steps, (.*)", head)
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    status = re.search(r"exit (\d+)", log.read_text())
    run = {"name": folder.name, "exit": int(status.group(1)) if status else None, "records": records}
    if match:
        run.update(shape=match[2], seq_len=int(match[3]), options=match[5].replace("--", "").strip())
    else:  # a run with its own command line (the VL preset)
        run.update(shape=head.split(": ", 1)[-1], seq_len=None, options="")
    if records:
        steady = [r["step_time_s"] for r in records[2:]] or [r["step_time_s"] for r in records]
        run["median_ms"] = statistics.median(steady) * 1000
        run["first_s"] = records[0]["step_time_s"]
        run["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in records[2:] or records)
        run["peak_gib"] = max(r["memory_gib"] for r in records)
    return run


def exit_status(run: dict) -> str:
    return "-" if run["exit"] is None else str(run["exit"])  # "-": the log has no exit line


def model_steps(runs: Path) -> dict[tuple[str, str, str, int], dict]:
    rows = {}
    for file in runs.glob("*/model_step.json"):
        for row in json.loads(file.read_text())["rows"]:
            if row.get("status") == "ok":
                rows[(file.parent.name, row["shape"], row["variant"], row["seq_len"])] = row
    return rows


def tables(runs: Path, command: str) -> str:
    device = (runs / "device.txt").read_text().strip().replace("\n", "; ")
    found = [r for r in (read_run(f) for f in sorted(runs.iterdir()) if f.is_dir()) if r]
    lines = [
        "# `sft-train` on one GPU, end to end",
        "",
        f"Device: {device}. Checkpoints written by transformers' `save_pretrained` (random init, bf16) and "
        "trained through `model.path`; `torchrun --standalone --nproc-per-node 1 -m sft_trainer.run`, NCCL, "
        "bf16, fla kernels, cp 1, AdamW. Rows: one document of exactly S tokens (benchmarks/gpu_train_assets.py "
        "long-docs), or the shipped tiny VL chat data. Logs and metrics of every run: `sft_train_gpu/`.",
        "",
        f"Reproduce: `{command}`, then `python benchmarks/sft_train_runs.py`.",
        "",
        "| run | shape | S | options | exit | first step s | ms / step | tokens/s | peak GiB | loss first -> last |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in found:
        if not r["records"]:
            lines.append(
                f"| {r['name']} | {r['shape']} | {r['seq_len']} | {r['options']} | {exit_status(r)} | - | - | - | - | - |"
            )
            continue
        loss = f"{r['records'][0]['loss']:.3f} -> {r['records'][-1]['loss']:.3f}"
        lines.append(
            f"| {r['name']} | {r['shape']} | {r['seq_len'] or '-'} | {r['options'] or '-'} | {exit_status(r)} "
            f"| {r['first_s']:.1f} | {r['median_ms']:.0f} | {r['tokens_per_s']:.0f} | {r['peak_gib']:.1f} | {loss} |"
        )
    steps = model_steps(runs)
    by_name = {r["name"]: r for r in found}
    lines += [
        "",
        "## The trainer against the model step",
        "",
        "The same shape, row and options; `model_step.py` times forward + backward alone (no optimizer, clipping, "
        "data or logging), in the same call on the same machine. Goal: >= 0.95x.",
        "",
        "| run | model step variant | S | trainer ms | model step ms | trainer / model step speed |",
        "|---|---|---|---|---|---|",
    ]
    for name, key in SAME_WORK.items():
        if name in by_name and key in steps and by_name[name].get("median_ms"):
            ours, ref = by_name[name]["median_ms"], steps[key]["ms"]
            lines.append(f"| {name} | {key[2]} | {key[3]} | {ours:.0f} | {ref:.0f} | {ref / ours:.2f}x |")
    if "r08_8k_fsdp" in by_name and "r08_8k_fsdp_resume" in by_name:
        full = {r["step"]: r for r in by_name["r08_8k_fsdp"]["records"]}
        lines += [
            "",
            "## Checkpoint and resume",
            "",
            "`r08_8k_fsdp` saved at step 5; `r08_8k_fsdp_resume` loaded it and ran steps 6-10. Relative difference "
            "of each step's loss and grad norm from the uninterrupted run:",
            "",
            "| step | loss | resumed loss | rel. diff | grad norm rel. diff |",
            "|---|---|---|---|---|",
        ]
        for r in by_name["r08_8k_fsdp_resume"]["records"]:
            a = full[r["step"]]
            lines.append(
                f"| {r['step']} | {a['loss']:.6f} | {r['loss']:.6f} | {abs(r['loss'] - a['loss']) / abs(a['loss']):.1e} "
                f"| {abs(r['grad_norm'] - a['grad_norm']) / abs(a['grad_norm']):.1e} |"
            )
    for file in sorted(runs.glob("*/export_logits.json")):
        result = json.loads(file.read_text())
        lines += [
            "",
            f"## Logits: `{file.parent.name}` (transformers {result['transformers']})",
            "",
            f"{result.get('what', '')}",
            "",
            "| document tokens | " + " | ".join(k for k in result["documents"][0] if k != "tokens") + " |",
            "|---|" + "---|" * (len(result["documents"][0]) - 1),
        ]
        for d in result["documents"]:
            lines.append(f"| {d['tokens']} | " + " | ".join(f"{v:.2e}" for k, v in d.items() if k != "tokens") + " |")
    notes = runs / "NOTES.md"  # what the numbers alone do not say, written by whoever ran them
    if notes.is_file():
        lines += ["", notes.read_text().strip()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=Path("docs/benchmarks/sft_train_gpu"))
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/sft_train_gpu.md"))
    parser.add_argument(
        "--command", default="bash benchmarks/gpu_train.sh 8k; ... 32k; ... more; ... final; ... compare; ... cold"
    )
    args = parser.parse_args()
    text = tables(args.runs, args.command)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
