"""Where one forward + backward makes the host wait for the GPU, and how far the step's wall time is from its GPU time.

    python benchmarks/host_syncs.py [--shapes qwen3_5-0.8b nemotron_h-nano-8l] [--seq-len 8192] [--docs 4] --out DIR

CUDA only: elsewhere it says so in one line and exits. Per shape (benchmarks/model_step.py's shapes and step: ours,
eager, bf16, one packed row of ``--docs`` equal documents), after two warm-up steps:

1. One step under ``torch.cuda.set_sync_debug_mode("warn")``: every synchronizing CUDA call torch reports, by the
   innermost frame of this repository's packages on the Python stack when it was raised. Warnings raised inside
   ``loss.backward()`` come back from autograd's threads at its end, so their stack ends there.
2. One step under torch.profiler with Python stacks: the CUDA runtime's synchronize calls and the host-to-device
   copies from pageable memory (which wait for the stream but raise no sync warning), each by the innermost frame
   of our packages in the stack of the operator that made it (backward operators without a Python frame are named
   by the operator).
3. Wall time: median of three unprofiled steps between device synchronizations; GPU time: the union of the
   profiled step's kernel and copy intervals (the time the GPU was busy) and their plain sum. Wall within ~10 % of
   the busy time means the host is no longer the bound.

Writes host_syncs.md (and .json) to --out and prints the markdown.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch
from model_step import SHAPES, build, load_shape

OUR_PACKAGES = ("cp_core", "cp_models", "cp_vlm", "sft_trainer")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
_STACK_ENTRY = re.compile(r"^(?P<file>.*)\((?P<line>\d+)\): (?P<func>.*)$")


def _ours(filename: str) -> bool:
    """Whether ``filename`` (a full path, or the profiler's ``package/module.py``) is in one of our packages."""
    return any(f"/{package}/" in "/" + filename for package in OUR_PACKAGES)


def _short(filename: str) -> str:
    for package in OUR_PACKAGES:
        if f"/{package}/" in "/" + filename:
            return package + "/" + ("/" + filename).split(f"/{package}/", 1)[1]
    return Path(filename).name


def site_of(frames: list[tuple[str, int, str]]) -> str:
    """The innermost frame of our packages in ``frames`` (innermost first), else the innermost frame at all."""
    for filename, line, func in frames:
        if _ours(filename):
            return f"{_short(filename)}:{line} ({func})"
    if frames:
        filename, line, func = frames[0]
        return f"{_short(filename)}:{line} ({func}) [outside our packages]"
    return "(no Python frame)"


def sync_warnings(step, ids) -> Counter:
    """Sync sites of one step under the sync debug mode: {(site, innermost frame, message): count}."""
    sites: Counter = Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [(f.filename, f.lineno, f.name) for f in reversed(traceback.extract_stack()[:-1])]
        frames = [f for f in frames if not f[0].endswith(("warnings.py", "host_syncs.py"))] or frames
        where = "inside loss.backward() (replayed at its end)" if _in_backward(frames) else site_of(frames)
        sites[(where, f"{Path(filename).name}:{lineno}", str(message).splitlines()[0][:80])] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(ids)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    return sites


def _in_backward(frames) -> bool:
    return any(func == "backward" and "torch/" in filename and "autograd" in filename for filename, _, func in frames)


def _event_frames(event) -> list[tuple[str, int, str]]:
    """The Python frames above ``event``, innermost first: from its ancestors that are Python-function events
    (torch's profiler records Python calls as events named ``file(line): function`` when ``with_stack`` is on), or
    from the first ancestor operator that carries a recorded stack."""
    frames = []
    while event is not None:
        match = _STACK_ENTRY.match(event.name)
        if match:
            frames.append((match["file"], int(match["line"]), match["func"]))
        elif event.stack:
            entries = [m.groupdict() for m in map(_STACK_ENTRY.match, event.stack) if m]
            recorded = [(e["file"], int(e["line"]), e["func"]) for e in entries]
            if recorded and "host_syncs.py" in recorded[0][0]:  # outermost first: turn it round
                recorded.reverse()
            return frames + recorded
        event = event.cpu_parent
    return frames


def _operator_chain(event) -> str:
    names = []
    while event is not None and len(names) < 3:
        names.append(event.name)
        event = event.cpu_parent
    return " <- ".join(names)


def profiled(step, ids) -> tuple[Counter, float, float]:
    """One profiled step: ({(kind, site): count} of synchronize calls and pageable copies, GPU busy ms, kernel sum
    ms)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        step(ids)
        torch.cuda.synchronize()
    events = prof.events()
    sites: Counter = Counter()
    intervals = []
    for event in events:
        if event.device_type == DeviceType.CUDA:
            intervals.append((event.time_range.start, event.time_range.end))
            continue
        if event.name in SYNC_CALLS:
            frames = _event_frames(event)
            where = site_of(frames) if frames else f"(no Python frame) {_operator_chain(event)}"
            sites[(event.name, where)] += 1
        for kernel in event.kernels:
            if "Pageable" in kernel.name:
                frames = _event_frames(event)
                where = site_of(frames) if frames else f"(no Python frame) {_operator_chain(event)}"
                sites[(kernel.name, where)] += 1
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    kernel_sum = sum(stop - start for start, stop in intervals)
    return sites, busy / 1000, kernel_sum / 1000


def wall_ms(step, ids, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step(ids)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def run_shape(shape: str, seq_len: int, docs: int) -> dict:
    config = load_shape(shape)
    model, step = build("cp_models", config, "cuda")
    lens = [seq_len // docs] * docs
    lens[-1] += seq_len - sum(lens)

    def one_step(ids):
        model.zero_grad(set_to_none=True)
        return step(ids, lens)

    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (seq_len,), device="cuda")
    for _ in range(2):
        one_step(ids)
    wall = wall_ms(one_step, ids)
    warned = sync_warnings(one_step, ids)
    sites, busy, kernel_sum = profiled(one_step, ids)
    return dict(
        shape=shape, seq_len=seq_len, seq_lens=lens, wall_ms=wall, gpu_busy_ms=busy, kernel_sum_ms=kernel_sum,
        warnings=[dict(site=s, raised_at=r, message=m, count=c) for (s, r, m), c in warned.most_common()],
        profiled=[dict(kind=k, site=s, count=c) for (k, s), c in sites.most_common()],
    )  # fmt: skip


def markdown(results: list[dict], device: str, argv: list[str]) -> str:
    lines = [
        f"# Host syncs of one forward + backward on one {device} (ours, eager, bf16)",
        "",
        f"Reproduce: `python benchmarks/host_syncs.py {' '.join(argv)}`. Method in the script's docstring.",
        "",
        "| shape | S | documents | wall ms | GPU busy ms | kernel sum ms | wall / busy |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['shape']} | {r['seq_len']} | {len(r['seq_lens'])} | {r['wall_ms']:.1f} | {r['gpu_busy_ms']:.1f} "
            f"| {r['kernel_sum_ms']:.1f} | {r['wall_ms'] / max(r['gpu_busy_ms'], 1e-9):.2f} |"
        )
    for r in results:
        lines += ["", f"## {r['shape']}: sync warnings (set_sync_debug_mode('warn')), per step", ""]
        lines += ["| site (our code) | raised at | message | count |", "|---|---|---|---|"]
        lines += [f"| {w['site']} | {w['raised_at']} | {w['message']} | {w['count']} |" for w in r["warnings"]]
        if not r["warnings"]:
            lines.append("| none | | | 0 |")
        lines += ["", f"## {r['shape']}: synchronize calls and pageable copies (profiler), per step", ""]
        lines += ["| kind | site (our code) | count |", "|---|---|---|"]
        lines += [f"| {p['kind']} | {p['site']} | {p['count']} |" for p in r["profiled"]]
        if not r["profiled"]:
            lines.append("| none | | 0 |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=["qwen3_5-0.8b", "nemotron_h-nano-8l"])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--docs", type=int, default=4, help="equal documents in the packed row")
    parser.add_argument("--out", type=Path, default=Path("/tmp/host_syncs"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_syncs.py needs a CUDA device (it measures GPU syncs); none is available here")
    results = []
    for shape in args.shapes:
        results.append(run_shape(shape, args.seq_len, args.docs))
        gc.collect()  # the shape's model is gone with run_shape's frame
        torch.cuda.empty_cache()
        print(json.dumps({k: v for k, v in results[-1].items() if k in ("shape", "wall_ms", "gpu_busy_ms")}))
    text = markdown(results, torch.cuda.get_device_name(), sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_syncs.md").write_text(text)
    (args.out / "host_syncs.json").write_text(json.dumps(results, indent=1))
    print(text)


if __name__ == "__main__":
    main()
