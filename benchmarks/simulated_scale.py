"""Simulated CP scale on one GPU: one rank's share of cp = N, on a ``fake`` process group (true shapes, no peers).

    python benchmarks/simulated_scale.py --shape qwen3_5-0.8b --points 131072:1 131072:8 262144:1 ... --out DIR
    uv run python benchmarks/simulated_scale.py --tiny --device cpu --points 512:1 512:2 1024:4 --out /tmp/x

Each point S:cp builds nothing new: the model (bf16, activation checkpointing unless --no-ckpt) gets the topology of
rank cp // 2 (``--rank middle``; or the first or last) of a ``fake`` group of cp ranks (its collectives return at
once with the right shapes and garbage data), then runs forward + backward of that rank's S / cp tokens of one document spanning the row (every rank
passes recurrent state and conv halo; attention is Ulysses, so each rank computes S x heads / cp, or beyond the
query heads all-gathered KV, where a rank's queries meet every earlier key of the document; ``--attention-cp kv_ring``
passes K|V blocks around the ring instead, whose received blocks are garbage on the fake group, as every collective's are). A short row per
cp compiles and autotunes first (most of fla's tuning keys exclude the length; its norms' do not). Measured at each point: the bytes this rank
sends, under ``cp_core.testing.CommCounter`` during a first step at the exact shape (checkpointing's recomputed
forward collectives included; its wall time is kept as first_step_s; ``--planned-bytes`` takes them from the
planner's closed forms instead, which the tests hold equal to the counted bytes), then compute time and peak
allocated memory of a second, uncounted step. Estimated: communication time = bytes / --nvlink-gbps (stated per-direction NVLink
bandwidth, no overlap with compute, no latency), step = compute + communication. Ideal memory at cp = N: the cp = 1
run's activation memory / N + the static memory (weights + gradients, measured before the step).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.utils.checkpoint
from model_step import SHAPES, build, free, load_shape, timed_steps

from cp_core.testing import CommCounter, fake_process_group
from cp_models import ContextParallelAttention

NVLINK_GBPS = 450.0  # H200 NVLink 4, per direction, GB/s (1e9 bytes)


def simulated_rank(cp: int, which: str) -> int:
    """The rank a point simulates: "first" (0: GDN pre-pass, no state through), "middle" (cp // 2: the state passes
    through at cp >= 4; the last rank at cp 2) or "last" (cp - 1: no pre-pass), of one document spanning the row."""
    return {"first": 0, "middle": cp // 2, "last": cp - 1}[which]


@contextlib.contextmanager
def _sharded(model, cp: int, rank: int, attention_cp: str = "auto"):
    """The model as ``rank`` of a fake group of cp ranks for the block (cp = 1: unsharded)."""
    from cp_core import CPTopology
    from cp_models import set_context_parallel_attributes

    with fake_process_group(rank, cp) as group:
        set_context_parallel_attributes(model, CPTopology.from_group(group), attention_cp_style=attention_cp)
        yield


def run(args, on_row) -> list[dict]:
    config = load_shape(args.shape, args.tiny)
    variant = "cp_models" if args.no_ckpt else "cp_models + act. ckpt"
    model, step = build(variant, config, args.device)
    cuda = args.device.startswith("cuda")
    static = torch.cuda.memory_allocated() / 2**30 if cuda else None  # weights; gradients come with the step
    grads_gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30  # as large as the weights
    points = [tuple(int(x) for x in p.split(":")) for p in args.points]
    rows, warmed = [], set()
    for seq_len, cp in sorted(points, key=lambda p: (p[1], p[0])):
        rank = simulated_rank(cp, args.rank)
        row = dict(shape=args.shape, variant=variant, seq_len=seq_len, cp=cp, rank=rank, local_tokens=seq_len // cp)
        if seq_len % cp:
            rows.append({**row, "status": "S % cp != 0"})
            continue
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(_sharded(model, cp, rank, args.attention_cp))
            except Exception as exc:  # the model's own CP validation (e.g. cp not dividing the attention heads)
                rows.append({**row, "status": f"rejected: {exc}"})
                on_row(rows)
                continue
            if cp > 1:  # the strategy the model's attention layers resolved to
                row["attention"] = next(
                    (m.attention_cp_style for m in model.modules() if isinstance(m, ContextParallelAttention)), None
                )
            generator = torch.Generator().manual_seed(0)
            if cp not in warmed:  # compile + autotune on a short row (most of fla's tuning keys exclude the length)
                short = max(args.warmup_tokens, cp) // cp * cp
                ids = torch.randint(0, config.vocab_size, (short // cp,), generator=generator).to(args.device)
                timed_steps(lambda x, s=short: step(x, [s]), ids, args.device, reps=1, warmup=1)
                model.zero_grad(set_to_none=True)
                warmed.add(cp)
            ids = torch.randint(0, config.vocab_size, (seq_len // cp,), generator=generator).to(args.device)
            counter = CommCounter(cp)

            def plain(x, s=seq_len):
                return step(x, [s])

            def counted(x, counter=counter):
                with counter:
                    return plain(x)

            # The first step at this exact shape counts the bytes; the second, outside the counter's dispatch mode, is
            # the one timed (a counted 128k step takes 48 s at cp 1: every aten op passes through Python). cp = 1 issues
            # no collectives and --memory-only wants only the peak: their first step runs uncounted. The first step
            # at a new length pays first-call costs (74 s at 128k on the H200, where 256k's second step took 35 s),
            # so --memory-only derives no rate from it.
            started = time.perf_counter()
            first_step = plain if cp == 1 or args.memory_only or args.planned_bytes else counted
            # Recording memory history breaks non-reentrant checkpointing's early stop when the last tensor a
            # recomputed layer saves comes from a custom autograd Function (the MLP's): torch 2.11 raises
            # "SystemError: ... apply ... returned NULL" (pytorch/pytorch#179536; reproduced on the H200). Without
            # early stop the recomputation runs to the layer's end and saves the same tensors.
            if args.snapshot:
                torch.cuda.memory._record_memory_history(max_entries=args.snapshot)
            with torch.utils.checkpoint.set_checkpoint_early_stop(not args.snapshot):
                first = timed_steps(first_step, ids, args.device, reps=1, warmup=0, limit_s=args.limit_s)
            if args.snapshot:
                row["peak_breakdown"] = peak_breakdown(torch.cuda.memory._snapshot())
                torch.cuda.memory._record_memory_history(enabled=None)
            model.zero_grad(set_to_none=True)
            result = first
            if first["status"] == "ok" and not args.memory_only:
                result = timed_steps(plain, ids, args.device, reps=1, warmup=0, limit_s=args.limit_s)
            row.update(result, first_step_s=first.get("first_step_s"), wall_s=time.perf_counter() - started)
            model.zero_grad(set_to_none=True)
            row["static_gib"] = None if static is None else static + grads_gib
            if args.memory_only:
                row.update(memory_only=True, ms=None)
            elif result["status"] == "ok":
                if args.planned_bytes:  # the planner's closed forms, tested equal to CommCounter's counts
                    sent = planned_bytes_sent(config, seq_len, cp, not args.no_ckpt, args.attention_cp)
                    collectives = None
                else:
                    sent, collectives = counter.total_sent_bytes, len(counter.records)
                row.update(
                    bytes_sent=sent,
                    bytes_from="sft_trainer.plan closed forms" if args.planned_bytes else "CommCounter",
                    collectives=collectives,
                    comm_ms=sent / (args.nvlink_gbps * 1e9) * 1000,
                    timed_step="second step at the shape, uncounted",
                )
                row["est_step_ms"] = row["ms"] + row["comm_ms"]
                row["tokens_per_s_per_gpu"] = seq_len / cp / row["est_step_ms"] * 1000
        rows.append(row)
        on_row(rows)
        free(args.device)
    return rows


def peak_breakdown(snapshot: dict, top: int = 12) -> list[dict]:
    """The blocks alive at the highest point of allocated memory in a ``torch.cuda.memory._snapshot()`` trace,
    summed per allocating site (the innermost frame in this repository's packages, else the innermost Python frame),
    largest first: [{"site", "gib", "blocks"}]."""
    events = [e for trace in snapshot.get("device_traces", []) for e in trace]

    def replay(stop: int) -> tuple[dict[int, dict], int]:
        """The blocks alive after ``events[:stop]`` and the index just past the highest total on the way."""
        live: dict[int, dict] = {}
        total = peak = peak_end = 0
        for i, event in enumerate(events[:stop]):
            if event["action"] == "alloc":
                live[event["addr"]] = event
                total += event["size"]
                if total > peak:
                    peak, peak_end = total, i + 1
            elif event["action"] == "free_completed" and event["addr"] in live:
                total -= live.pop(event["addr"])["size"]
        return live, peak_end

    at_peak, _ = replay(replay(len(events))[1])  # the second pass stops at the peak (no copy per new maximum)
    sites: dict[str, list[int]] = {}
    for size, site in ((e["size"], _site(e.get("frames", []))) for e in at_peak.values()):
        entry = sites.setdefault(site, [0, 0])
        entry[0] += size
        entry[1] += 1
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"site": site, "gib": size / 2**30, "blocks": count} for site, (size, count) in ranked]


def _site(frames: list[dict]) -> str:
    python = [f for f in frames if f.get("filename", "").endswith(".py")]
    ours = [f for f in python if "/packages/" in f["filename"] or "/benchmarks/" in f["filename"]]
    frame = (ours or python or [{"filename": "?", "line": 0, "name": "?"}])[0]
    return f"{frame['filename'].split('/')[-1]}:{frame['line']} {frame['name']}"


def planned_bytes_sent(config, seq_len: int, cp: int, recompute: bool, attention_cp: str = "auto") -> int:
    """Bytes the busiest rank sends per step by ``sft_trainer.plan``'s closed forms (every layer kind, bf16): at
    cp >= 4 what rank cp // 2 sends; at cp = 2 rank 1 is the last rank and sends a little less (no halo forward)."""
    from sft_trainer import plan
    from sft_trainer.plan.build import _layer_rows

    per_token = plan.activation_bytes_per_token(config, cp, attention_cp=attention_cp)
    rows = _layer_rows(config, seq_len, cp, "state_passing", 2, recompute, per_token, attention_cp)
    return int(sum(r["bytes"] for r in rows))


def _ideal(rows: list[dict], baseline: Path | None = None) -> None:
    """Ideal per-rank memory at cp = N from the cp = 1 run at the same S: activations / N + static. A cp = 1 row of
    this run comes first; else one from ``baseline`` (an earlier run's json of the same shape and variant), named in
    the row's ``ideal_base``. Where no cp = 1 run exists at S (one GPU cannot hold it), the cp = 1 activations are
    extrapolated linearly in S through the two longest cp = 1 runs (checkpointed activations and flash attention's
    memory grow linearly in S), and ``ideal_base`` says so."""

    def ones(candidates: list[dict]) -> dict[int, dict]:
        return {r["seq_len"]: r for r in candidates if r["cp"] == 1 and r.get("status") == "ok" and r.get("peak_gib")}

    base = ones(rows)
    earlier: dict[int, dict] = {}
    if baseline is not None:
        kept = json.loads(baseline.read_text())["rows"]
        earlier = ones([r for r in kept if r["shape"] == rows[0]["shape"] and r["variant"] == rows[0]["variant"]])
    known = {**earlier, **base}
    for r in rows:
        if r.get("status") != "ok" or not r.get("peak_gib") or r["cp"] == 1:
            continue
        static = r["static_gib"]
        one = base.get(r["seq_len"]) or earlier.get(r["seq_len"])
        if one is not None:
            activations = one["peak_gib"] - static
            r["ideal_base"] = "this run" if r["seq_len"] in base else f"{baseline.name} ({one['peak_gib']:.2f} GiB)"
        elif len(known) >= 2:
            (s0, r0), (s1, r1) = sorted(known.items())[-2:]
            a0, a1 = r0["peak_gib"] - static, r1["peak_gib"] - static
            activations = a1 + (a1 - a0) * (r["seq_len"] - s1) / (s1 - s0)
            r["ideal_base"] = f"extrapolated from cp 1 at {s0} and {s1}"
        else:
            continue
        r["ideal_gib"] = activations / r["cp"] + static
        r["vs_ideal"] = r["peak_gib"] / r["ideal_gib"]


def _bytes_source(rows: list[dict]) -> str:
    if any(r.get("bytes_from", "").startswith("sft_trainer") for r in rows):
        return "the busiest rank sends (the planner's closed forms, which the tests hold equal to the counted bytes)"
    return "this rank sends (counted)"


def write_table(rows: list[dict], args, device_name: str) -> str:
    lines = [
        f"# Simulated CP scale: one rank's share on one {device_name} ({args.shape}, bf16, "
        f"{'no checkpointing' if args.no_ckpt else 'activation checkpointing'})",
        "",
        "A `fake` process group stands in for the other ranks (method in benchmarks/simulated_scale.py): compute and",
        f"peak memory are measured; communication = bytes {_bytes_source(rows)} / {args.nvlink_gbps:.0f} GB/s",
        "NVLink, added without overlap. ideal = cp 1 activations / cp + weights and gradients.",
        "",
        f"Reproduce on the GPU machine (fla staged): `python benchmarks/simulated_scale.py {shlex.join(sys.argv[1:])}`",
        "",
        "| S | cp | tokens / rank | compute ms | MiB sent | comm ms | est. step ms | tokens/s/GPU | peak GiB "
        "| ideal GiB | peak / ideal |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        strategy = f" ({r['attention']})" if r.get("attention") in ("kv_gather", "kv_ring") else ""
        head = f"| {r['seq_len']} | {r['cp']}{strategy} | {r['local_tokens']} "
        if r.get("status") != "ok":
            lines.append(head + f"| {r['status']} | | | | | | | |")
            continue
        peak = "-" if r.get("peak_gib") is None else f"{r['peak_gib']:.1f}"
        ideal = f"{r['ideal_gib']:.1f} | {r['vs_ideal']:.3f}" if "ideal_gib" in r else "- | -"
        if r.get("memory_only"):
            lines.append(
                head + f"| (memory only; first step {r['first_step_s']:.0f} s) | - | - | - | - | {peak} | {ideal} |"
            )
            continue
        lines.append(
            head + f"| {r['ms']:.0f} | {r['bytes_sent'] / 2**20:.1f} | {r['comm_ms']:.1f} | {r['est_step_ms']:.0f} "
            f"| {r['tokens_per_s_per_gpu']:.0f} | {peak} | {ideal} |"
        )
    bases = sorted({r["ideal_base"] for r in rows if r.get("ideal_base", "this run") != "this run"})
    earlier = [b for b in bases if not b.startswith("extrapolated")]
    if earlier:
        lines += [
            "",
            f"cp = 1 peaks for the ideal taken from an earlier run of the same shape and variant: {', '.join(earlier)}.",
        ]
    extrapolated = [b for b in bases if b.startswith("extrapolated")]
    if extrapolated:
        lines += [
            "",
            f"Where one GPU cannot run cp = 1 at S, its activations are {'; '.join(extrapolated)} (linear in S).",
        ]
    if any(r.get("memory_only") for r in rows):
        lines += ["", "memory only (`--memory-only`): one uncounted step per point, for its peak; its wall time includes",
                  "first-call costs at a new shape, so no rate is derived from it."]  # fmt: skip
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"simulated_scale_{args.shape}"
    (args.out / f"{stem}.md").write_text(text)
    (args.out / f"{stem}.json").write_text(json.dumps({"device": device_name, "rows": rows}, indent=1))
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=SHAPES, default="qwen3_5-0.8b")
    parser.add_argument("--points", nargs="+", default=["131072:1", "131072:2", "131072:4", "131072:8"],
                        help="S:cp pairs")  # fmt: skip
    parser.add_argument("--no-ckpt", action="store_true", help="without activation checkpointing")
    parser.add_argument("--warmup-tokens", type=int, default=16384, help="row length of the warm-up step per cp")
    parser.add_argument("--nvlink-gbps", type=float, default=NVLINK_GBPS)
    parser.add_argument("--limit-s", type=float, default=200.0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--memory-only", action="store_true",
                        help="one uncounted step per point: peak memory only (no bytes, no rate)")  # fmt: skip
    parser.add_argument("--planned-bytes", action="store_true",
                        help="bytes from the planner's closed forms instead of a counted first step (a counted step "
                        "runs 2.9x slower, so this leaves time to time a second step at every point)")  # fmt: skip
    parser.add_argument("--rank", choices=("first", "middle", "last"), default="middle",
                        help="which rank of one document spanning the row: 0, cp // 2 or cp - 1")  # fmt: skip
    parser.add_argument("--snapshot", type=int, default=0, metavar="ENTRIES",
                        help="CUDA: record the first step's allocations (this many trace entries) and keep the "
                        "blocks alive at its peak, by allocating site, in the row's peak_breakdown")  # fmt: skip
    parser.add_argument("--attention-cp", choices=("auto", "ulysses", "kv_gather", "kv_ring"), default="auto",
                        help="softmax attention's CP strategy (auto: Ulysses where the heads allow, else all-gather KV; "
                        "kv_ring: K|V blocks around the ring)")  # fmt: skip
    parser.add_argument("--baseline", type=Path, default=None,
                        help="an earlier run's json whose cp = 1 rows give the ideal where this run has none")  # fmt: skip
    args = parser.parse_args()
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"

    def on_row(rows):  # rewritten after every point, so a run cut short keeps what it measured
        print(json.dumps(rows[-1]), flush=True)
        _ideal(rows, args.baseline)
        write_table(rows, args, device_name)

    print(write_table(run(args, on_row), args, device_name))


if __name__ == "__main__":
    main()
