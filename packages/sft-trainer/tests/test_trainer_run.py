"""End-to-end CPU runs of ``sft-train``: cp = 2 equals cp = 1, resume reproduces the uninterrupted run, and the HF
export loads in transformers with the same logits."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trainer_runs import (
    FORK_WORKERS,
    STEPS,
    _assert_same_run,
    _train,
    _train_runs,
    one_line_failure,
    read_wandb_records,
    sft_train,
    wandb_items,
)

from sft_trainer.checkpoint import EXTRA_FORMAT, data_change_problem
from sft_trainer.config import load_config
from sft_trainer.data import tiny_chat_path

# cp1_run (conftest.py): the unsharded single-process reference run.


def test_torchrun_cp2_fsdp_equals_cp1_and_logs_to_wandb(cp1_run, tmp_path):
    """Started by torchrun (2 processes) instead of spawning its own workers: cp = 2 with FSDP2 sharding over both
    ranks gives the unsharded single process's numbers. With logging.wandb.enabled (offline, the default mode)
    rank 0 also writes a wandb run holding the config and every step's metrics (read back from the run file's
    records)."""
    pytest.importorskip("wandb")
    wandb = ("--logging.wandb.enabled", "true", "--logging.wandb.project", "cptest")
    metrics = _train(tmp_path, "--parallel.cp", "2", "--checkpoint.export_hf", "true", *wandb, torchrun_procs=2)
    _assert_same_run(cp1_run, (tmp_path, metrics))
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    records = read_wandb_records(runs[0])
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.project == "cptest" and wandb_items(run.config.update)["parallel"]["cp"] == 2
    history = [wandb_items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    assert [h["_step"] for h in history] == [m["step"] for m in metrics]
    for logged, written in zip(history, metrics, strict=True):  # every step's values, as rank 0 wrote them
        assert {k: logged[k] for k in written} == written


def test_dp2_cp2_fsdp_equals_cp1_with_accumulation(cp1_run, tmp_path):
    """dp = 2 replicas of cp = 2 (4 ranks, FSDP2 over all four), one row per replica and step, equals one process
    accumulating the same two rows: the loss is the exact per-token mean over dp x cp. Attention here gathers the
    keys and values (parallel.attention_cp = "kv_gather"; the torchrun test above runs Ulysses)."""
    overrides = (
        "--parallel.cp",
        "2",
        "--parallel.dp",
        "2",
        "--train.grad_accum",
        "1",
        "--parallel.attention_cp",
        "kv_gather",
    )
    _assert_same_run(cp1_run, (tmp_path, _train(tmp_path, *overrides)))


@pytest.fixture(scope="module")
def ring_and_resume(tmp_path_factory) -> dict[str, tuple[Path, list[dict]]]:
    """cp = 2 with the attention's keys and values passed around the ring (parallel.attention_cp = "kv_ring"), FSDP2
    over both ranks and a checkpoint after every step ("full"); the run resumed from its step-1 checkpoint
    ("resumed"); then a fresh run into the resumed run's folder ("again"). One launcher trains them in turn."""
    folder = tmp_path_factory.mktemp("ring")
    cp2 = ("--parallel.cp", "2", "--parallel.attention_cp", "kv_ring")
    runs = {
        "full": (*cp2, "--checkpoint.every", "1"),
        "resumed": (*cp2, "--checkpoint.resume", str(folder / "full" / "checkpoints" / "step-000001")),
        "again": cp2,
    }
    outs = {"full": folder / "full", "resumed": folder / "resumed", "again": folder / "resumed"}
    trained = dict(zip(runs, _train_runs(*((outs[name], overrides) for name, overrides in runs.items())), strict=True))
    # "again" set the resumed run's metrics aside, to metrics.1.jsonl: read them there
    lines = (folder / "resumed" / "metrics.1.jsonl").read_text().splitlines()
    trained["resumed"] = [json.loads(line) for line in lines]
    return {name: (outs[name], m) for name, m in trained.items()}


def test_cp2_ring_attention_equals_cp1(cp1_run, ring_and_resume):
    """The ring run gives the unsharded single process's numbers."""
    _assert_same_run(cp1_run, ring_and_resume["full"])


def test_resume_reproduces_losses(ring_and_resume, tmp_path):
    full, metrics = ring_and_resume["full"]
    ckpt = full / "checkpoints" / "step-000001"
    assert ckpt.exists()
    resumed_dir, resumed = ring_and_resume["resumed"]
    assert [m["step"] for m in resumed] == list(range(2, STEPS + 1))
    for a, b in zip([m["loss"] for m in metrics][1:], [m["loss"] for m in resumed], strict=True):
        assert a == pytest.approx(b, rel=1e-6, abs=0)
    # A fresh run into the same folder sets the resumed run's outputs aside (nothing lost, nothing mixed) and
    # trains from step 1: the uninterrupted run's losses.
    _, again = ring_and_resume["again"]
    assert [m["step"] for m in again] == list(range(1, STEPS + 1))
    for a, b in zip([m["loss"] for m in metrics], [m["loss"] for m in again], strict=True):
        assert a == pytest.approx(b, rel=1e-6, abs=0)
    assert (resumed_dir / "metrics.1.jsonl").read_text().count("\n") == STEPS - 1
    assert sorted(p.name for p in (resumed_dir / "checkpoints.1").iterdir()) == ["latest", f"step-{STEPS:06d}"]
    assert (resumed_dir / "checkpoints" / "latest").read_text() == f"step-{STEPS:06d}"
    # The checkpoint records its data's fingerprint: other data is refused in one line, before any worker starts.
    recorded = json.loads((ckpt / "extra-rank0.json").read_text())["data_fingerprint"]
    assert re.fullmatch(r"tokens-\w+/pack-\w+", recorded)
    changed = tmp_path / "changed.jsonl"
    changed.write_text("".join(tiny_chat_path().read_text().splitlines(keepends=True)[:-1]))
    proc, _ = sft_train(
        *("--output_dir", str(tmp_path / "changed"), "--parallel.cp", "2", "--train.steps", str(STEPS)),
        *("--train.warmup_steps", "1"),
        *("--data.seq_len", "128", "--data.path", str(changed), "--checkpoint.resume", str(ckpt)),
    )
    line = one_line_failure(proc)  # the one problem, on the line itself
    assert line.startswith("sft-train: cannot resume: ") and "  - " not in proc.stderr, proc.stderr
    found = re.findall(r"tokens-\w+/pack-\w+", line)
    assert len(found) == 2 and found[0] == recorded and found[1] != recorded, line
    assert "checkpoint.allow_data_change = true" in line and "[sft-train] dp=" not in proc.stdout


def test_data_change_is_refused_unless_allowed(tmp_path):
    """A checkpoint whose recorded data fingerprint differs from the run's data is refused, naming both, unless
    checkpoint.allow_data_change is set; one without a fingerprint resumes as before."""
    ckpt = tmp_path / "step-000001"
    ckpt.mkdir()
    state = {"format": EXTRA_FORMAT, "step": 1, "train_steps": 3, "grad_accum": 1, "world_size": 1, "scheduler": {}}
    (ckpt / "extra-rank0.json").write_text(json.dumps({**state, "data_fingerprint": "tokens-a/pack-b"}))
    cfg = load_config(None, ["--checkpoint.resume", str(ckpt)], fetch_weights=False)
    assert data_change_problem(cfg, "tokens-a/pack-b") is None
    problem = data_change_problem(cfg, "tokens-c/pack-b")
    assert "fingerprint tokens-a/pack-b" in problem and "has tokens-c/pack-b" in problem
    allowed = load_config(None, ["--checkpoint.resume", str(ckpt), "--checkpoint.allow_data_change", "true"])
    assert data_change_problem(allowed, "tokens-c/pack-b") is None
    (ckpt / "extra-rank0.json").write_text(json.dumps(state))
    assert data_change_problem(cfg, "tokens-c/pack-b") is None


def test_data_without_rows_stops_with_one_clean_line(tmp_path):
    """A problem every worker meets alike (here: a data file of blank lines, no conversation; a file of 0 bytes is
    refused before launch) ends the run with the field, the value and the reason on one line, not a traceback per
    process."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    proc = subprocess.run(
        [sys.executable, "-c", "from sft_trainer.cli import main; main()", "--output_dir", str(tmp_path / "out"),
         "--data.path", str(empty), "--data.seq_len", "128"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1
    assert f"sft-train: data.path={str(empty)!r}: no packed rows: nothing to train on (rows=0" in proc.stderr
    assert "the data holds no conversation with any tokens" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert re.search(r"\nsft-train: stopped \(worker \d exited with code 1\)$", proc.stderr.rstrip()), proc.stderr
    assert proc.stderr.count("no packed rows") == 1  # rank 0 says why; the other rank just stops


STOPPING_WORKERS = """
import os, time
import torch.distributed as dist
import sft_trainer.run as run
from sft_trainer.watchdog import run_workers

def target(rank, port, delay, beats):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo")
    try:
        if rank == 0:
            time.sleep(delay)
        run._stop(rank, "the reason, said once")
    finally:
        dist.destroy_process_group()

def go(delay):
    run_workers(target, (run._free_port(), delay), 2, 0)
"""


def test_a_stop_waits_for_rank_0_to_say_why(tmp_path):
    """Rank 1 meets the problem 3 s before rank 0 does: it waits at the stop's barrier until rank 0 has printed the
    reason, so the launcher (which ends every worker once one ends) never cuts that line off."""
    (tmp_path / "stopping_workers.py").write_text(STOPPING_WORKERS)
    script = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import stopping_workers; stopping_workers.go(3.0)"
    script = FORK_WORKERS + script  # the workers forked, not spawned: the stop's barrier is the subject here
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.count("sft-train: the reason, said once\n") == 1, proc.stderr[-2000:]
    assert re.search(r"sft-train: stopped \(worker \d exited with code 1\)$", proc.stderr.rstrip()), proc.stderr


WORKER_EXITS = [
    ("return {}", 0, None, False),
    ("raise SystemExit(1)", 1, None, False),
    ("raise SystemExit('no packed rows for dp rank 1')", 1, "no packed rows for dp rank 1", False),
    ("raise KeyboardInterrupt", 130, None, False),
    ("raise ValueError('boom')", 1, "ValueError: boom", True),
]
WORKER_STARTS = {"spawned": "run._spawned(0, None, 1, 0)", "torchrun": "run.launch(None)"}

# One interpreter imports sft_trainer.run, then forks a child per case; each child's stderr goes to its own file.
_EXIT_DRIVER = """
import json, os, sys
import sft_trainer.run as run
results = {}
for key, body, start, path in json.loads(sys.argv[1]):
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
        namespace = {}
        exec("def worker(cfg):\\n    " + body + "\\n", namespace)
        run.worker = namespace["worker"]
        exec(start, {"run": run})
        sys.stderr.write("AssertionError: the worker returned instead of exiting")
        sys.stderr.flush()
        os._exit(99)
    results[key] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def worker_exits(tmp_path_factory) -> dict[str, tuple[int, str]]:
    """(start, body) case -> (exit code, stderr) of a worker process that ran it."""
    folder = tmp_path_factory.mktemp("worker_exits")
    cases = [
        (f"{start}|{body}", body, WORKER_STARTS[start], str(folder / f"{i}.err"))
        for i, (start, (body, *_)) in enumerate((s, c) for s in WORKER_STARTS for c in WORKER_EXITS)
    ]
    env = {**os.environ, "RANK": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", _EXIT_DRIVER, json.dumps(cases)], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes = json.loads(proc.stdout.splitlines()[-1])
    return {key: (codes[key], Path(path).read_text()) for key, _, _, path in cases}


@pytest.mark.parametrize(("body", "code", "stderr_has", "traceback"), WORKER_EXITS)
@pytest.mark.parametrize("start", list(WORKER_STARTS))
def test_worker_keeps_its_exit_code_and_message(worker_exits, start, body, code, stderr_has, traceback):
    """A worker (spawned, or started by torchrun: RANK set) leaves through os._exit on every path, since a gloo
    thread at interpreter teardown can abort the process with SIGABRT, which the launcher would report as a
    crash: the code, the SystemExit message and an unexpected error's traceback must all survive that exit."""
    returncode, stderr = worker_exits[f"{start}|{body}"]
    assert returncode == code, stderr[-2000:]
    if stderr_has is None:
        assert stderr == ""
    else:
        assert stderr_has in stderr
    assert ("Traceback" in stderr) == traceback, stderr[-2000:]


def test_hf_export_loads_in_transformers(cp1_run):
    from transformers import AutoModelForCausalLM

    from cp_models import Qwen35ForCausalLM

    out, _ = cp1_run
    hf = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    ours = Qwen35ForCausalLM.from_pretrained(out / "hf")
    ids = torch.randint(0, hf.config.vocab_size, (24,))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        got = ours(ids, [24]).logits
    assert ((got - ref).abs().max() / ref.abs().max()) < 1e-5


def test_loss_falls(tmp_path):
    metrics = _train(tmp_path, "--parallel.cp", "2", "--train.steps", "24", "--train.lr", "3e-3")
    losses = [m["loss"] for m in metrics]
    assert sum(losses[-4:]) / 4 < 0.8 * sum(losses[:4]) / 4, losses


def test_nemotron_h_trains_under_both_mamba_strategies(nemotron_runs):
    """The tiny Nemotron-H preset trains end to end (nemotron_runs, conftest.py): cp = 2 under state passing and
    under head-parallel a2a both give the cp = 1 losses, and the HF export loads in transformers'
    NemotronHForCausalLM with our logits."""
    from transformers import AutoModelForCausalLM

    from cp_models import NemotronHForCausalLM

    ref = nemotron_runs["cp1"][1]
    for style in ("state_passing", "a2a"):
        got = nemotron_runs[style][1]
        for a, b in zip([m["loss"] for m in ref], [m["loss"] for m in got], strict=True):
            assert abs(a - b) <= 1e-5 * abs(a), (style, ref, got)
    assert ref[-1]["loss"] < ref[0]["loss"]
    export = nemotron_runs["a2a"][0] / "hf"
    hf = AutoModelForCausalLM.from_pretrained(export).eval()
    assert type(hf).__name__ == "NemotronHForCausalLM"
    ours = NemotronHForCausalLM.from_pretrained(export)
    ids = torch.randint(0, hf.config.vocab_size, (24,))
    with torch.no_grad():
        ref_logits = hf(ids[None]).logits[0]
        assert ((ours(ids, [24]).logits - ref_logits).abs().max() / ref_logits.abs().max()) < 1e-5


def test_fla_configs_are_written_under_cp_fla_tuning_dir_only(monkeypatch, tmp_path):
    """After the first GPU step rank 0 writes fla's choices into $CP_FLA_TUNING_DIR/<GPU>/fla-<version>; without
    that variable, or without fla, nothing is written (never into the package's shipped folder)."""
    from cp_core import fla_tuning
    from sft_trainer import run

    written = []
    monkeypatch.setattr(run, "write_fla_tuning", lambda folder: written.append(folder) or 0)
    monkeypatch.setattr(run, "fla_version", lambda: "0.6.0")
    monkeypatch.setattr(fla_tuning, "fla_version", lambda: "0.6.0")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.delenv(fla_tuning.TUNING_DIR_ENV, raising=False)
    run.keep_fla_tuning(torch.device("cuda", 0))
    assert written == []
    monkeypatch.setenv(fla_tuning.TUNING_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(run, "fla_version", lambda: None)
    run.keep_fla_tuning(torch.device("cuda", 0))
    assert written == []
    monkeypatch.setattr(run, "fla_version", lambda: "0.6.0")
    run.keep_fla_tuning(torch.device("cuda", 0))
    assert written == [tmp_path / "NVIDIA_H100_80GB_HBM3" / "fla-0.6.0"]
