"""``sft-train report RUN_DIR``: a run's metrics.jsonl as a PNG (loss, lr, grad norm, tokens/s, memory vs step)
and a short text summary. The PNG needs matplotlib (``pip install 'sft-trainer[report]'``); the summary does not."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

# metrics.jsonl key -> the panel's title
PANELS = {
    "loss": "loss",
    "lr": "learning rate",
    "grad_norm": "grad norm",
    "tokens_per_s": "tokens/s",
    "memory_gib": "peak memory (GiB)",
}


class ReportError(Exception):
    """A run folder or metrics file that cannot be reported on (the message is one line)."""


def _record_problem(record: Any) -> str | None:
    """Why a parsed metrics line is not a record the trainer writes, or None: a step that is a whole number >= 0
    and a loss that is a number (NaN / Infinity for a skipped step) or null (a step without loss tokens)."""
    if not isinstance(record, dict):
        return f"needs a JSON object with a step and a loss, got {json.dumps(record)[:80]}"
    if "step" not in record or "loss" not in record:
        return f"no {'step' if 'step' not in record else 'loss'}; a record has a step and a loss"
    step, loss = record["step"], record["loss"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return f"step={json.dumps(step)[:80]}: a step is a whole number >= 0"
    if loss is not None and (isinstance(loss, bool) or not isinstance(loss, (int, float))):
        return f"loss={json.dumps(loss)[:80]}: a loss is a number, or null for a step without loss tokens"
    return None


def _skipped(record: dict[str, Any]) -> bool:
    """A step the trainer did not apply: marked skipped, or its loss is not finite (the trainer skips those)."""
    loss = record["loss"]
    return bool(record.get("skipped")) or (loss is not None and not math.isfinite(loss))


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl, one per step; ReportError naming the file and line of a malformed one."""
    if path.is_dir():
        raise ReportError(f"{path}: is a folder, not a metrics file")
    if not path.is_file():
        raise ReportError(f"{path}: no such file (sft-train writes it into the run's output_dir)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ReportError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}), not a metrics.jsonl") from None
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise ReportError(f"{path}:{number}: not a JSON object: {exc}") from None
        if problem := _record_problem(record):
            raise ReportError(f"{path}:{number}: not a metrics record ({problem})")
        records.append(record)
    if not records:
        raise ReportError(f"{path}: holds no steps")
    return records


def _values(records: list[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in records if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Steps, first / last / min loss of the steps that were applied, median tokens/s, peak memory, skipped steps,
    steps without loss tokens and the time spent in steps (the sum of step_time_s; startup and checkpoints not
    included)."""
    applied = [r for r in records if not _skipped(r)]
    losses = _values(applied, "loss")
    tokens_per_s = _values(records, "tokens_per_s")
    memory = _values(records, "memory_gib")
    return {
        "steps": len(records),
        "last_step": records[-1]["step"],
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "min_loss": min(losses) if losses else None,
        "median_tokens_per_s": statistics.median(tokens_per_s) if tokens_per_s else None,
        "peak_memory_gib": max(memory) if memory else None,
        "skipped": len(records) - len(applied),
        "no_loss_tokens": sum(1 for r in records if r.get("tokens") == 0),
        "step_time_s": sum(_values(records, "step_time_s")),
    }


def format_summary(summary: dict[str, Any]) -> str:
    def num(value: float | None, fmt: str) -> str:
        return "n/a" if value is None else format(value, fmt)

    return "\n".join(
        [
            f"steps: {summary['steps']} (last step {summary['last_step']}), skipped (non-finite): {summary['skipped']}"
            + (f", without loss tokens: {summary['no_loss_tokens']}" if summary.get("no_loss_tokens") else ""),
            f"loss: first {num(summary['first_loss'], '.4f')}, last {num(summary['last_loss'], '.4f')}, "
            f"min {num(summary['min_loss'], '.4f')}",
            f"tokens/s (median): {num(summary['median_tokens_per_s'], '.0f')}",
            "peak memory: "
            + ("n/a" if summary["peak_memory_gib"] is None else f"{summary['peak_memory_gib']:.2f} GiB"),
            f"time in steps: {summary['step_time_s']:.1f} s",
        ]
    )


def plot(records: list[dict[str, Any]], png: Path) -> None:
    """One panel per metric against the step; skipped steps are marked on the loss panel."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, safe in a worker without a display

    keys = [k for k in PANELS if _values(records, k)]
    fig = Figure(figsize=(8, 2.2 * len(keys)), layout="constrained")
    axes = fig.subplots(len(keys), 1, sharex=True, squeeze=False)[:, 0]
    for ax, key in zip(axes, keys, strict=True):
        points = [
            (r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
        ]
        ax.plot([s for s, _ in points], [v for _, v in points], linewidth=1.2)
        ax.set_title(PANELS[key], fontsize=10, loc="left")
        ax.grid(alpha=0.3)
        if key == "loss":
            for record in records:
                if _skipped(record):
                    ax.axvline(record["step"], color="red", alpha=0.4, linewidth=0.8)
    axes[-1].set_xlabel("step")
    fig.savefig(png, dpi=100)


def report(run_dir: Path, metrics: Path | None = None) -> tuple[str, Path | None]:
    """(the summary text, report.png's path or None without matplotlib) for ``run_dir``'s metrics."""
    if run_dir.is_file():
        raise ReportError(f"{run_dir}: is a file; name the run folder that holds it ({run_dir.parent})")
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: no such run folder")
    records = read_metrics(metrics or run_dir / "metrics.jsonl")
    summary = format_summary(summarize(records))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return summary, None
    png = run_dir / "report.png"
    plot(records, png)
    return summary, png


def write_report_at_end(metrics: Path, run_dir: Path) -> dict[str, Any]:
    """The end of a training run: prints the summary, writes report.png when matplotlib is installed, and returns
    the summary's numbers (empty when there are none). Never stops the run."""
    try:
        summary, png = report(Path(run_dir), Path(metrics))
        numbers = summarize(read_metrics(Path(metrics)))
    except Exception as exc:  # the run's outputs are written; a report that fails is only noted
        print(f"[sft-train] no report: {type(exc).__name__}: {exc}", flush=True)
        return {}
    print(summary, flush=True)
    if png is not None:
        print(f"[sft-train] report: {png}", flush=True)
    return {key: value for key, value in numbers.items() if value is not None}
