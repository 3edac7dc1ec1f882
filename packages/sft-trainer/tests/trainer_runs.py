"""Running ``sft-train`` end to end from tests, and comparing two runs' metrics and exported weights."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from cp_core.testing import relative_l2

STEPS = 3


# Prepended to a script that starts workers through torch.multiprocessing: they are forked from it instead of
# spawned as fresh interpreters, each of which imports torch again (10-20 s on a loaded 2-core machine). For tests
# whose subject is what the workers do; test_trainer_faults, test_trainer_bad_inputs, test_trainer_watch and the
# torchrun runs start the real spawned or torchrun launch.
FORK_WORKERS = """
import torch.multiprocessing as mp

_start_processes = mp.start_processes


def start_processes(*args, start_method="spawn", **kwargs):
    return _start_processes(*args, start_method="fork", **kwargs)


mp.start_processes = start_processes
"""
# One launcher process runs the given sft-train runs in turn, each as `sft-train ARGS` would (its folders released
# when it ends, as at a process's exit), forking each run's workers, with the modules a worker imports loaded once.
_RUNS_LAUNCHER = (
    FORK_WORKERS
    + """
import json, os, sys
import sft_trainer.data, sft_trainer.lora, sft_trainer.model, sft_trainer.run, sft_trainer.tokenizer_fit
from sft_trainer import run_folder
from sft_trainer.cli import main

for argv in json.loads(sys.argv[1]):
    print("sft-train " + " ".join(argv), file=sys.stderr, flush=True)
    main(argv)
    while run_folder._held:
        os.close(run_folder._held.pop())
"""
)


def _args(out: Path, overrides: tuple[str, ...]) -> list[str]:
    return ["--output_dir", str(out), "--train.steps", str(STEPS), "--data.seq_len", "128", "--train.warmup_steps", "1",
            "--model.dtype", "float32", "--logging.progress_bar", "false", *overrides]  # fmt: skip


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _train_runs(*runs: tuple[Path, tuple[str, ...]]) -> list[list[dict]]:
    """The metrics of each (output folder, overrides) run, trained in turn by one launcher that forks its workers."""
    argvs = [_args(out, overrides) for out, overrides in runs]
    cmd = [sys.executable, "-c", _RUNS_LAUNCHER, json.dumps(argvs)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600 * len(runs))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [_metrics(out) for out, _ in runs]


def _train(out: Path, *overrides: str, torchrun_procs: int = 0) -> list[dict]:
    if not torchrun_procs:
        return _train_runs((out, overrides))[0]
    # torchrun sets RANK/WORLD_SIZE; sft-train then runs as one of its workers
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun_procs}"]
    cmd = [sys.executable, *launcher, "-m", "sft_trainer.run", *_args(out, overrides)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return _metrics(out)


def sft_train(*args: str, timeout: float = 300, **popen) -> tuple[subprocess.CompletedProcess, float]:
    """``sft-train ARGS`` in a subprocess, whatever its exit: the finished process and its wall time in seconds."""
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", "from sft_trainer.cli import main; main()", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        **popen,
    )
    return proc, time.monotonic() - started


def worker_in_process(monkeypatch, argv: list[str]) -> int:
    """sft-train's worker as the only rank of a gloo group in this process: the code it exits with."""
    import torch.distributed as dist

    from sft_trainer.config import load_config
    from sft_trainer.run import worker

    env = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    c10d = dist.distributed_c10d  # the worker sets torch's default timeouts to the run's collective timeout
    monkeypatch.setattr(c10d, "default_pg_timeout", c10d.default_pg_timeout)
    monkeypatch.setattr(c10d, "default_pg_nccl_timeout", c10d.default_pg_nccl_timeout)
    try:
        worker(load_config(None, argv))
    except SystemExit as exc:
        assert not dist.is_initialized()
        return exc.code if isinstance(exc.code, int) else 1
    raise AssertionError("the worker trained instead of stopping")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_line_failure(proc: subprocess.CompletedProcess, code: int = 1) -> str:
    """The single ``sft-train: ...`` line a failed run printed (asserting: that code, no traceback, said once)."""
    assert proc.returncode == code, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("sft-train: ")]
    lines = [line for line in lines if not line.startswith("sft-train: stopped (worker")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "hf" / "model.safetensors"))


def _assert_same_run(run1: tuple[Path, list[dict]], run2: tuple[Path, list[dict]]) -> None:
    (out1, metrics1), (out2, metrics2) = run1, run2
    losses1, losses2 = [m["loss"] for m in metrics1], [m["loss"] for m in metrics2]
    assert len(losses1) == len(losses2) == STEPS
    for a, b in zip(losses1, losses2, strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), (losses1, losses2)
    assert [m["tokens"] for m in metrics1] == [m["tokens"] for m in metrics2]
    w1, w2 = _weights(out1), _weights(out2)
    assert w1.keys() == w2.keys()
    # Per tensor in the L2 norm. Exception, measured: the GDN decay-gate parameters (in_proj_a, A_log, dt_bias).
    # At transformers' init (A up to 16) most decays underflow, so their true gradients are ~0 and their fp32
    # gradients are rounding noise that differs between the CP and unsharded runs; Adam's first steps move each
    # weight by about lr * sign(grad), noise included (seen: 1.4e-2 on in_proj_a, 1e-3 on dt_bias). The model's
    # own gradients agree (tests/test_models_qwen35_cp.py, exact in fp64). Their differences then feed the later
    # steps' forward passes, so the other tensors drift too: measured up to 2.3e-5 after 3 steps (limit 1e-4).
    gates = ("linear_attn.in_proj_a.weight", "linear_attn.A_log", "linear_attn.dt_bias")
    diffs = {n: relative_l2(w2[n], w1[n], floor=1e-12) for n in w1}
    strict = {n: d for n, d in diffs.items() if not n.endswith(gates)}
    worst = sorted(strict.items(), key=lambda x: -x[1])[:5]
    assert len(strict) > len(diffs) - 10 and max(strict.values()) <= 1e-4, worst
    assert max(diffs.values()) <= 5e-2, sorted(diffs.items(), key=lambda x: -x[1])[:5]


def read_wandb_records(path: Path) -> list:
    """The protobuf records of a .wandb file: a ':W&B' header, then a LevelDB-style log (32 KiB blocks; each
    chunk: crc32c, little-endian length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4) of wandb_internal Records."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if kind == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_items(items) -> dict:
    """A wandb record's key/value items as a dict of decoded JSON values (nested keys joined with ".")."""
    return {(i.key or ".".join(i.nested_key)): json.loads(i.value_json) for i in items}
