"""Faults while a run is going (CPU, gloo, cp = 2): a second run into the same folder, a frozen worker (heartbeat
and collective timeout), a killed launcher, SIGINT and SIGTERM to the launcher alone, a full disk during a save.
Each ends with its exit code and one line, within the time asserted, and leaves no folder held."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from faults import fault_env
from trainer_runs import one_line_failure, sft_train

from sft_trainer.cli import main
from sft_trainer.config import load_config
from sft_trainer.run_folder import LOCK_NAME, hold_run_folders

LONG = ("--parallel.cp", "2", "--data.seq_len", "64", "--train.steps", "100000", "--train.warmup_steps", "0",
        "--logging.progress_bar", "false", "--checkpoint.export_hf", "false", "--model.dtype", "float32")  # fmt: skip


def _start(out: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-c", "from sft_trainer.cli import main; main()", "--output_dir", str(out), *LONG, *extra]
    # A suite started as a background job (`cmd &` without job control) runs with SIGINT ignored, which children
    # inherit and Python then keeps: the launcher starts with SIGINT at its default, as from a terminal.
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _wait_for_step(out: Path, proc: subprocess.Popen, timeout: float = 180) -> None:
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if metrics.exists() and metrics.read_text().count("\n") >= 1:
            return
        time.sleep(0.2)
    raise AssertionError("no training step within the timeout")


def _workers(launcher: int) -> list[int]:
    """The launcher's workers, rank order (they start in rank order): spawned, or forked by its fork server."""
    pids = []
    for pid in map(int, Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        if "forkserver" in cmdline:
            pids.extend(map(int, Path(f"/proc/{pid}/task/{pid}/children").read_text().split()))
        elif "spawn_main" in cmdline and "resource_tracker" not in cmdline:
            pids.append(pid)
    return sorted(pids)


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), time.monotonic() - started


def _gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{pid}").exists() and "Z" not in _state(pid) for pid in pids):
            return True
        time.sleep(0.1)
    return False


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_a_second_run_stops_naming_the_first_and_a_frozen_worker_ends_the_run(tmp_path):
    """While run A trains: run B into the same folder stops at once naming A's pid (A goes on, its metrics
    untouched). Then worker 1 of A is frozen (SIGSTOP): the launcher names it within the heartbeat timeout and
    ends every worker; the folder is free again."""
    out = tmp_path / "out"
    run_a = _start(out, "--parallel.heartbeat_timeout_s", "4")
    try:
        _wait_for_step(out, run_a)
        proc, seconds = sft_train("--output_dir", str(out), *LONG)
        line = one_line_failure(proc)
        assert line.startswith(f"sft-train: {out} is in use by another run (pid {run_a.pid} on "), line
        # config checks only, no worker starts; the launcher shares the cores with run A's two workers and with its
        # own fork server, which imports the workers' modules until the refusal ends it
        assert seconds < 45, seconds
        assert run_a.poll() is None and (out / "metrics.jsonl").read_text().count("\n") >= 1
        workers = _workers(run_a.pid)
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGSTOP)
        frozen_at = time.monotonic()
        done, _ = _finish(run_a, timeout=60)
        waited = time.monotonic() - frozen_at
    finally:
        if run_a.poll() is None:
            run_a.kill()
    line = one_line_failure(done)
    assert line.startswith(f"sft-train: worker 1 (pid {workers[1]}) stopped answering: no heartbeat for "), line
    assert "(parallel.heartbeat_timeout_s=4)" in line
    assert waited < 4 + 10, waited  # the timeout, the kill grace, a margin for a loaded machine
    assert _gone(workers, 5)
    print(f"frozen worker: run ended {waited:.1f} s after SIGSTOP; second run refused in {seconds:.1f} s")
    hold_run_folders(load_config(None, ["--output_dir", str(out)]))  # not left held


def test_a_collective_timeout_ends_a_frozen_run_without_heartbeats(tmp_path):
    """With the heartbeat off, the other rank's collective times out and names itself; the launcher ends the
    frozen one."""
    out = tmp_path / "out"
    run = _start(out, "--parallel.heartbeat_timeout_s", "0", "--parallel.collective_timeout_s", "10")
    try:
        _wait_for_step(out, run)
        workers = _workers(run.pid)
        os.kill(workers[1], signal.SIGSTOP)
        frozen_at = time.monotonic()
        done, _ = _finish(run, timeout=90)
        waited = time.monotonic() - frozen_at
    finally:
        if run.poll() is None:
            run.kill()
    line = one_line_failure(done)
    assert line == (
        "sft-train: rank 0: a collective timed out after 10 s (parallel.collective_timeout_s): another rank "
        "stopped answering (frozen, stuck or dead)"
    ), done.stderr[-2000:]
    assert done.stderr.rstrip().endswith("sft-train: stopped (worker 0 exited with code 1)")
    assert waited < 10 + 15, waited
    assert _gone(workers, 5)
    print(f"collective timeout: run ended {waited:.1f} s after SIGSTOP")


def _signal_the_launcher(out, sig: signal.Signals):
    """Start a run into ``out``, send ``sig`` to its launcher alone (not its process group) once a step is done;
    ``(the finished process or None for SIGKILL, its workers, seconds from the signal to the end, its pid)``."""
    run = _start(out)
    try:
        _wait_for_step(out, run)
        workers = _workers(run.pid)
        run.send_signal(sig)
        sent = time.monotonic()
        if sig == signal.SIGKILL:
            run.wait()
            assert _gone(workers, 10), [_state(p) for p in workers]
            return None, workers, time.monotonic() - sent, run.pid
        done, _ = _finish(run, timeout=60)
        return done, workers, time.monotonic() - sent, run.pid
    finally:
        if run.poll() is None:
            run.kill()


def test_sigint_to_the_launcher_stops_the_workers_and_a_killed_launcher_frees_the_folder(tmp_path):
    done, workers, waited, _ = _signal_the_launcher(tmp_path / "out", signal.SIGINT)
    assert one_line_failure(done, code=130) == "sft-train: interrupted (SIGINT); every worker was stopped"
    assert _gone(workers, 5) and waited < 15, waited
    steps = (tmp_path / "out" / "metrics.jsonl").read_text().count("\n")
    # SIGTERM (a scheduler's preemption or cancel): the same clean stop, said as such
    done, workers, _, _ = _signal_the_launcher(tmp_path / "terminated", signal.SIGTERM)
    assert one_line_failure(done, code=143) == "sft-train: terminated (SIGTERM); every worker was stopped"
    assert _gone(workers, 5)
    # SIGKILL to the launcher (a crash): its workers notice within a second or two and stop; the folder is free
    out = tmp_path / "crashed"
    _, _, orphans_gone, pid = _signal_the_launcher(out, signal.SIGKILL)
    assert json.loads((out / LOCK_NAME).read_text())["pid"] == pid  # the file stays, the hold does not
    hold_run_folders(load_config(None, ["--output_dir", str(out)]))
    print(f"SIGINT: {waited:.1f} s ({steps} steps); killed launcher: workers gone in {orphans_gone:.1f} s")


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    env = fault_env(tmp_path / "fault", "enospc_at_step_2")
    out = tmp_path / "out"
    proc, seconds = sft_train(
        "--output_dir", str(out), *LONG, "--train.steps", "3", "--checkpoint.every", "1", env=env
    )  # fmt: skip
    line = one_line_failure(proc)
    assert line.startswith(f"sft-train: no space left on the device while saving checkpoint {out / 'checkpoints'}")
    assert "latest still names step-000001" in line
    assert (out / "checkpoints" / "latest").read_text() == "step-000001"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-000001"]
    print(f"full disk: {seconds:.1f} s")


def test_a_killed_worker_then_resume_reproduces_the_uninterrupted_run(tmp_path):
    """Rank 1 is SIGKILLed as step 4 starts (checkpoints every 2 steps): the run stops naming it; resuming
    continues from step 2, replays step 3, and the losses equal the uninterrupted run's bit for bit, with one
    metrics record per step."""
    short = ("--train.steps", "5", "--checkpoint.every", "2")
    reference, _ = sft_train("--output_dir", str(tmp_path / "ref"), *LONG, *short)
    assert reference.returncode == 0, reference.stderr[-3000:]
    out = tmp_path / "out"
    env = fault_env(tmp_path / "fault", "sigkill_rank1_at_step_4")
    crashed, seconds = sft_train("--output_dir", str(out), *LONG, *short, env=env)
    assert (
        one_line_failure(crashed) == "sft-train: worker 1 was killed by SIGKILL (most often the out-of-memory "
        "killer: see dmesg)"
    )
    assert (out / "checkpoints" / "latest").read_text() == "step-000002"
    assert (out / "metrics.jsonl").read_text().count("\n") == 3
    resumed, _ = sft_train("--output_dir", str(out), *LONG, *short, "--checkpoint.resume", "true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want = [json.loads(line) for line in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
    got = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in got] == [1, 2, 3, 4, 5]
    assert [m["loss"] for m in got] == [m["loss"] for m in want]
    assert [m["grad_norm"] for m in got] == [m["grad_norm"] for m in want]
    print(f"killed worker: stopped in {seconds:.1f} s; resume bit-exact over {len(got)} steps")


@pytest.mark.parametrize("kind", ["file", "unwritable"])
def test_unwritable_outputs_are_refused_before_launch(tmp_path, kind):
    """Each output path under a file, or in a read-only folder: one line naming the field, before any worker."""
    blocker = tmp_path / "blocker"
    if kind == "file":
        blocker.write_text("x")
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes anywhere")
        blocker.mkdir()
        blocker.chmod(0o500)
    target = blocker / "sub"
    for field in ("output_dir", "checkpoint.dir", "logging.metrics_file"):
        args = [] if field == "output_dir" else ["--output_dir", str(tmp_path / "out")]
        with pytest.raises(SystemExit) as info:
            main([*args, f"--{field}", str(target)])
        lines = str(info.value.code).splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"sft-train: {field}={str(target)!r}: "), lines
        assert not (tmp_path / "out").exists()


def test_of_ranks_failing_with_the_same_line_exactly_one_claims_it(monkeypatch):
    """Every rank raising the same resume error: each would read its own text back from a compare-and-set on the
    line, so each would print it; the claim counter lets the first rank alone speak."""
    import torch.distributed as dist

    from sft_trainer import job_failure

    monkeypatch.delenv(job_failure.LAUNCHER_DIR_ENV, raising=False)
    store = dist.HashStore()
    line = "sft-train: cannot resume: checkpoint.resume: step-000002 was written by 2 rank(s)"
    assert [job_failure.claim(line, store) for _ in range(4)] == [True, False, False, False]
    assert store.get(f"{job_failure.key_prefix()}failure").decode() == line
