"""Data pipeline at scale: time until every rank holds its first row (cold and warm token cache), memory per rank,
padding, build throughput, and for image data the lazy image path's images/s.

    python benchmarks/make_chat_data.py --out /tmp/chat100k.jsonl --conversations 100000
    python benchmarks/data_scale.py --data /tmp/chat100k.jsonl --seq-len 8192 --cp 2 --cache /tmp/cache --out r.json
    python benchmarks/data_scale.py ... --train          # also time `sft-train` (tiny model) to its first step

One run is a cold start (the cache folder is emptied first) and then a warm one (the same cache), each in fresh
processes: ``cp`` gloo ranks on this machine (one node), rank 0 building with ``--num-proc`` processes (default:
every core) while rank 1 waits, then every rank maps the store and assembles its first row (and ``--rows`` more,
to show that reading rows does not grow memory). Memory is each rank's resident set (``VmRSS``) after reading the
rows minus before opening the data; the build's peak is the largest resident set of rank 0 and of its tokenizing
processes. ``--processor`` (a VL processor folder, e.g. the shipped tiny one) reads image data and times
the images/s of rows with images.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

# torch is imported where used: the tokenizing processes that spawn starts re-import this script as their main


def _rss_mib(kind: str = "VmRSS") -> float:
    """This process's resident memory: ``VmRSS`` all of it, ``RssAnon`` its own (heap), ``RssFile`` mapped file
    pages (the token store's pages among them: page cache, shared by the ranks and reclaimable)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(kind + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from sft_trainer.data import load_image_processor, tiny_tokenizer_dir
    from sft_trainer.data.rows import open_packed_store_distributed

    dist.init_process_group("gloo")
    tokenizer = AutoTokenizer.from_pretrained(args.processor or args.tokenizer or tiny_tokenizer_dir())
    processor = load_image_processor(args.processor) if args.processor else None
    dist.barrier()
    rss0, anon0, file0, started = _rss_mib(), _rss_mib("RssAnon"), _rss_mib("RssFile"), time.perf_counter()
    dataset = open_packed_store_distributed(
        args.data,
        tokenizer,
        args.seq_len,
        seed=0,
        cache_dir=args.cache,
        num_proc=args.num_proc,
        image_processor=processor,
    )
    row = dataset[0]  # dp = 1: every cp rank trains on row 0 first
    ready = time.perf_counter() - started
    dist.barrier()
    all_ready = time.perf_counter() - started
    rss_first = _rss_mib()
    step = max(1, len(dataset) // max(1, args.rows))
    picked = range(0, len(dataset), step)[: args.rows]
    images, image_seconds = 0, 0.0
    for i in picked:
        t = time.perf_counter()
        r = dataset[i]
        if r.image_grid_thw is not None:
            images += len(r.image_grid_thw)
            image_seconds += time.perf_counter() - t
    result = {
        "rank": rank,
        "first_row_s": ready,
        "all_ranks_ready_s": all_ready,
        "rss_delta_first_row_mib": rss_first - rss0,
        "rss_delta_after_rows_mib": _rss_mib() - rss0,
        "anon_delta_after_rows_mib": _rss_mib("RssAnon") - anon0,
        "file_delta_after_rows_mib": _rss_mib("RssFile") - file0,
        "rows_read": len(picked),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "children_peak_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        "row_tokens": int(row.input_ids.numel()),
        "rows": len(dataset),
        "stats": dataset.stats.as_dict(),
        "padding_pct": 100 * (1 - dataset.efficiency),
        "build": dataset.store.manifest["build"],
        "store_tokens": dataset.store.num_tokens,
        "store_documents": dataset.store.num_documents,
        "images_read": images,
        "images_per_s": images / image_seconds if image_seconds else None,
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(args: argparse.Namespace, out: Path) -> list[dict]:
    import torch.multiprocessing as mp

    out.mkdir(parents=True, exist_ok=True)
    mp.spawn(_rank, args=(args.cp, _free_port(), args, str(out)), nprocs=args.cp, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(args.cp)]


def time_sft_train(args: argparse.Namespace, output_dir: Path) -> float:
    """Seconds from launching ``sft-train`` (tiny model, this data) to its first step line."""
    cmd = [sys.executable, "-c", "from sft_trainer.cli import main; main()"]
    cmd += ["--data.path", str(args.data), "--data.seq_len", str(args.seq_len), "--parallel.cp", str(args.cp)]
    cmd += ["--data.cache_dir", str(args.cache), "--train.steps", "1", "--train.warmup_steps", "0"]
    cmd += ["--output_dir", str(output_dir), "--checkpoint.export_hf", "false"]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seconds = float("nan")
    for line in proc.stdout:
        sys.stderr.write(line)
        if line.startswith("step ") and seconds != seconds:
            seconds = time.perf_counter() - started
    proc.wait()
    if proc.returncode:
        raise SystemExit(f"sft-train failed ({proc.returncode})")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--cache", type=Path, required=True, help="token cache folder (emptied for the cold run)")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--num-proc", type=int, default=None, help="tokenizing processes (default: every core)")
    parser.add_argument("--rows", type=int, default=200, help="rows read after the first (memory, images/s)")
    parser.add_argument("--tokenizer", type=Path, default=None)
    parser.add_argument("--processor", type=Path, default=None, help="VL processor folder (image data)")
    parser.add_argument("--train", action="store_true", help="also time sft-train to its first step")
    parser.add_argument("--warm-only", action="store_true", help="keep the cache: measure a warm start only")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    work = Path(args.cache).parent / (Path(args.cache).name + "-bench")
    report: dict = {
        "data": str(args.data),
        "data_mb": args.data.stat().st_size / 1e6,
        "seq_len": args.seq_len,
        "cp": args.cp,
        "cores": os.cpu_count(),
    }
    for phase in ("warm",) if args.warm_only else ("cold", "warm"):
        if phase == "cold":
            shutil.rmtree(args.cache, ignore_errors=True)
        report[phase] = measure(args, work / phase)
        print(json.dumps({phase: report[phase][0]}, indent=1), flush=True)
    if args.train:
        shutil.rmtree(args.cache, ignore_errors=True)
        report["sft_train_first_step_cold_s"] = time_sft_train(args, work / "train-cold")
        report["sft_train_first_step_warm_s"] = time_sft_train(args, work / "train-warm")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k not in ("cold", "warm")}, indent=1))


if __name__ == "__main__":
    main()
