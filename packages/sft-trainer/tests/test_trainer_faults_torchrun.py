"""Failures under ``sft-torchrun`` (torchrun's agent in sft-train's own launcher, CPU, gloo): one line, once, per
host. Two hosts are simulated on this machine: two launchers with ``--nnodes 2 --nproc-per-node 1`` that meet at
one localhost rendezvous; a worker frozen on host 1 (SIGSTOP) ends both within the heartbeat timeout, and with the
heartbeat off, within the collective timeout. Also: a mistake in the config (said by the launcher, before any
worker), a worker's one-line stop (said once, not by each rank nor with torchrun's summary), and the store claim
that lets one rank alone speak."""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from trainer_runs import _free_port

from sft_trainer import job_failure
from sft_trainer.torchrun import main, split_arguments

TRAIN = ("--parallel.cp", "2", "--data.seq_len", "64", "--train.warmup_steps", "0", "--logging.progress_bar", "false",
         "--checkpoint.export_hf", "false", "--model.dtype", "float32")  # fmt: skip
TORCHRUN_NOISE = ("Traceback", "ChildFailedError", "FAILED", "torch.distributed", "Root Cause")


def _launch(*args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sft_trainer.torchrun", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _worker(launcher: int, timeout: float = 180) -> int:
    """The pid of the launcher's one worker (its child with RANK set), once it runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in map(int, Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()):
            with contextlib.suppress(OSError):
                if b"\0RANK=" in b"\0" + Path(f"/proc/{pid}/environ").read_bytes():
                    return pid
        time.sleep(0.2)
    raise AssertionError("the launcher's worker did not start")


def _gone(pid: int) -> bool:
    try:
        return "Z" in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True


def _user_lines(stderr: str) -> list[str]:
    """What a failure printed for the user: its sft-train lines; asserting nothing of torchrun's report came."""
    assert not any(noise in stderr for noise in TORCHRUN_NOISE), stderr[-3000:]
    return [line for line in stderr.splitlines() if line.startswith(("sft-train: ", "sft-torchrun: "))]


def _two_hosts_with_host_1_frozen(out: Path, *extra: str, timeout: float) -> tuple[list, int, float]:
    """Two launchers (hosts 0 and 1), 1 worker each; host 1's worker is stopped (SIGSTOP) after the first step.
    Returns each launcher's (exit code, stderr), the frozen pid, and the seconds until both had exited."""
    port = _free_port()
    hosts = ("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
             f"127.0.0.1:{port}", "--rdzv-id", f"two-hosts-{port}")  # fmt: skip
    args = ("--output_dir", str(out), *TRAIN, "--train.steps", "100000", *extra)
    launchers = [_launch(*hosts, "--node-rank", "0", *args)]
    time.sleep(1.0)  # host 0 hosts the rendezvous store
    launchers.append(_launch(*hosts, "--node-rank", "1", *args))
    frozen = None
    try:
        frozen = _worker(launchers[1].pid)
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            assert all(p.poll() is None for p in launchers), [p.communicate()[1][-2000:] for p in launchers]
            assert time.monotonic() < deadline, "no training step"
            time.sleep(0.2)
        os.kill(frozen, signal.SIGSTOP)
        frozen_at = time.monotonic()
        ends = [p.communicate(timeout=timeout)[1] for p in launchers]
        waited = time.monotonic() - frozen_at
        assert _gone(frozen), "the frozen worker outlived its launcher"
    finally:
        for p in launchers:
            if p.poll() is None:
                p.kill()
        if frozen is not None and Path(f"/proc/{frozen}").exists():
            os.kill(frozen, signal.SIGKILL)
    return [(p.returncode, err) for p, err in zip(launchers, ends, strict=True)], frozen, waited


def test_a_frozen_worker_on_another_host_ends_every_host_with_one_line_each(tmp_path):
    """Heartbeat 4 s: rank 0 (host 0) names rank 1 (host 1) in the job's store; host 1's launcher kills its frozen
    worker; both launchers exit non-zero, each with the one line naming rank 1, within the bound."""
    ends, frozen, waited = _two_hosts_with_host_1_frozen(
        tmp_path / "out", "--parallel.heartbeat_timeout_s", "4", timeout=60
    )
    for host, (code, stderr) in enumerate(ends):
        lines = _user_lines(stderr)
        assert code == 1 and len(lines) == 1, (host, code, stderr[-3000:])
        assert lines[0].startswith(f"sft-train: rank 0: rank 1 (pid {frozen} on "), lines
        assert "stopped answering: no heartbeat for " in lines[0] and "heartbeat_timeout_s=4)" in lines[0]
    assert ends[0][1].splitlines()[-1].endswith("[this host: rank 0 exited with code 1]")
    assert ends[1][1].splitlines()[-1].endswith("[this host: rank 1 killed by SIGKILL]")
    assert waited < 4 + 12, waited  # the timeout, a beat, the launchers' poll and shutdown, a loaded machine
    print(f"two hosts, rank 1 frozen: both launchers ended {waited:.1f} s after the SIGSTOP")


def test_with_the_heartbeat_off_a_collective_timeout_ends_every_host_with_one_line_each(tmp_path):
    """Heartbeat off, collective timeout 10 s: rank 0's collective times out and says so once; host 1's launcher
    reads that the job failed and ends its frozen worker."""
    ends, _, waited = _two_hosts_with_host_1_frozen(
        tmp_path / "out", "--parallel.heartbeat_timeout_s", "0", "--parallel.collective_timeout_s", "10", timeout=90
    )
    want = "sft-train: rank 0: a collective timed out after 10 s (parallel.collective_timeout_s): "
    for host, (code, stderr) in enumerate(ends):
        lines = _user_lines(stderr)
        assert code == 1 and len(lines) == 1 and lines[0].startswith(want), (host, code, stderr[-3000:])
        assert "rank 1 stopped answering (no heartbeat for " in lines[0], lines  # the ranks still beat
    # host 1's worker is killed by its launcher, or its agent finds the job's store closed first: both seen
    assert (
        ends[1][1]
        .splitlines()[-1]
        .endswith(("[this host: rank 1 killed by SIGKILL]", "after the job failed (RendezvousConnectionError)]"))
    )
    assert waited < 10 + 20, waited  # the timeout, the launchers' grace (5 s) and shutdown, a loaded machine
    print(f"two hosts, heartbeat off: both launchers ended {waited:.1f} s after the SIGSTOP")


def test_a_stop_every_rank_meets_is_said_once_by_the_launcher(tmp_path):
    """2 ranks on one host, data without a loss token: rank 0's line, once, with the ranks that ended; no
    torchrun summary."""
    proc = subprocess.run(
        [sys.executable, "-m", "sft_trainer.torchrun", "--standalone", "--nproc-per-node", "2",
         "--output_dir", str(tmp_path / "out"), *TRAIN, "--data.seq_len", "8"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = _user_lines(proc.stderr)
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("sft-train: data.path=") and "no packed row holds a loss token" in lines[0]
    assert lines[0].endswith("[this host: rank 0 exited with code 1, rank 1 exited with code 1]"), lines


def test_a_run_that_succeeds_prints_its_steps_and_no_failure(tmp_path):
    """One worker, 2 steps: exit 0, the step lines on stdout, nothing of ours (nor torchrun's) on stderr."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "sft_trainer.torchrun", "--standalone", "--nproc-per-node", "1", "--output_dir",
         str(out), *TRAIN, "--parallel.cp", "1", "--train.steps", "2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0 and _user_lines(proc.stderr) == [], proc.stderr[-3000:]
    steps = [line.split(" | ")[0] for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert steps == ["step     1/2", "step     2/2"], proc.stdout[-3000:]
    assert (out / "metrics.jsonl").read_text().count("\n") == 2


def test_the_launcher_refuses_a_config_or_option_mistake_before_any_worker(tmp_path, capsys):
    out = str(tmp_path / "out")
    for argv, want in (
        (["--standalone", "--output_dir", out, "--train.lr", "inf"], "train.lr=inf: must be a finite number"),
        (["--standalone", "--bogus", "3", "--output_dir", out], "sft-torchrun: unrecognized arguments: --bogus"),
        (["--standalone", "-m", "x.py", "--output_dir", out], "sft-torchrun: -m: the script is always"),
        (["--nproc-per-node", "2", "--output_dir", "/proc/sft-out"], "sft-train: output_dir='/proc/sft-out': "),
    ):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert str(info.value.code).count(want) == 1, info.value.code
    assert not (tmp_path / "out").exists() and capsys.readouterr().err == ""
    argv = ["--nnodes", "2", "--config", "a.toml", "--train.lr=1", "--master-addr", "10.0.0.1", "--output_dir", "o",
            "-r", "3"]  # fmt: skip
    assert split_arguments(argv) == (
        ["--nnodes", "2", "--master-addr", "10.0.0.1", "-r", "3"],
        ["--config", "a.toml", "--train.lr=1", "--output_dir", "o"],
    )


def test_of_ranks_failing_together_the_first_claim_alone_speaks(monkeypatch):
    """Eight ranks (threads, each its own store client) say their line at once: one line is printed, and it is
    the one the store holds."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.delenv(job_failure.LAUNCHER_DIR_ENV, raising=False)
    clients = [dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=10))
               for _ in range(8)]  # fmt: skip
    said, start = [], threading.Barrier(8)

    def rank(r: int) -> None:
        start.wait()
        if job_failure.claim(f"sft-train: rank {r}: a collective timed out", clients[r]):
            said.append(r)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(said) == 1
    assert (
        server.get(f"{job_failure.key_prefix()}failure").decode()
        == f"sft-train: rank {said[0]}: a collective timed out"
    )
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    assert not job_failure.say_once("sft-train: rank 9: late", clients[0]) and stream.getvalue() == ""


def test_a_rank_that_lost_the_claim_stays_until_the_line_is_said(monkeypatch):
    """Leaving at once would end the job before the winner speaks (torchrun stops the other ranks): the loser waits
    for the winner's mark, at most SAID_WAIT_S, and leaves as soon as the mark is there."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.delenv(job_failure.LAUNCHER_DIR_ENV, raising=False)
    monkeypatch.setattr(job_failure, "SAID_WAIT_S", 1.5)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    winner, loser = (dist.TCPStore("127.0.0.1", server.port, is_master=False) for _ in range(2))
    assert job_failure.claim("sft-train: rank 0: bad", winner)
    started = time.monotonic()
    assert not job_failure.say_once("sft-train: rank 1: bad", loser)
    assert 1.4 <= time.monotonic() - started < 3.0  # no mark yet: waited its whole bound
    threading.Timer(0.3, job_failure._mark_said, args=(winner,)).start()
    started = time.monotonic()
    assert not job_failure.say_once("sft-train: rank 1: bad", loser)
    assert 0.25 <= time.monotonic() - started < 1.2  # left once the winner marked its line said
    assert sys.stderr.getvalue() == ""
