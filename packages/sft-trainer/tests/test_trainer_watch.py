"""Watching a run: the progress bar on a terminal and plain lines elsewhere, ``sft-train report`` (PNG + summary),
and what an offline wandb run holds (read back from its .wandb file)."""

from __future__ import annotations

import fcntl
import io
import json
import math
import os
import pty
import re
import signal
import socket
import statistics
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from trainer_runs import read_wandb_records, wandb_items

from sft_trainer.cli import report_main
from sft_trainer.progress import Progress, plain_line
from sft_trainer.report import format_summary, read_metrics, summarize
from sft_trainer.train import MetricsWriter, StepStats

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _stats(step: int, skipped: bool = False) -> StepStats:
    extra = {"memory_gib": 1.5 + step / 100, "tokens_per_s": 1000.0 * step}
    return StepStats(step, 2.0 / step, 100, 0.5, 1e-4 * step, 0.25, skipped, extra)


def _plain(step: int, total: int, skipped: bool = False) -> str:
    s = _stats(step)
    return (
        f"step {step:5d}/{total} | loss {s.loss:.4f} | tok/s {1000.0 * step:9.0f} | step {250.0:7.1f} ms | "
        f"mem {1.5 + step / 100:.2f} GiB" + (" | SKIPPED (non-finite)" if skipped else "")
    )


def test_a_terminal_gets_a_bar_with_step_eta_and_numbers():
    out = _Terminal()
    progress = Progress(total=4, start=0, log_every=1, progress_bar=True, stream=out)
    for step in range(1, 5):
        progress.update(_stats(step, skipped=step == 3))
    progress.close()
    text = out.getvalue()
    assert "4/4" in text and re.search(r"\[\d\d:\d\d<\d\d:\d\d", text), text  # step / total, elapsed < ETA
    assert "loss 0.5000 | lr 4.00e-04 | tok/s 4000 | mem 1.54 GiB" in text, text
    assert "step 3: SKIPPED (non-finite loss or gradient)\n" in text
    assert "|  step" not in text and "step     1/4" not in text  # no plain lines under the bar


def test_a_resumed_run_starts_the_bar_at_its_step():
    out = _Terminal()
    progress = Progress(total=10, start=6, log_every=1, progress_bar=True, stream=out)
    progress.update(_stats(7))
    progress.close()
    assert "7/10" in out.getvalue() and "1/10" not in out.getvalue()


@pytest.mark.parametrize("terminal,progress_bar", [(False, True), (True, False)])
def test_plain_lines_off_a_terminal_or_with_progress_bar_false(terminal, progress_bar):
    out = _Terminal() if terminal else io.StringIO()
    progress = Progress(total=5, start=0, log_every=2, progress_bar=progress_bar, stream=out)
    for step in range(1, 6):
        progress.update(_stats(step, skipped=step == 4))
    progress.close()
    assert out.getvalue().splitlines() == [_plain(2, 5), _plain(4, 5, skipped=True), _plain(5, 5)]


def test_a_step_without_loss_tokens_shows_no_loss_in_line_bar_and_report(tmp_path):
    silent = StepStats(2, None, 0, 0.0, 1e-4, 0.25, False, {"memory_gib": 1.5, "tokens_per_s": 1000.0})
    assert plain_line(silent, 3) == (
        "step     2/3 | loss    n/a | tok/s      1000 | step   250.0 ms | mem 1.50 GiB | no loss tokens (not applied)"
    )
    out = _Terminal()
    progress = Progress(total=3, start=1, log_every=1, progress_bar=True, stream=out)
    progress.update(silent)
    progress.close()
    assert "loss    n/a | lr 1.00e-04" in out.getvalue()
    metrics = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(metrics)
    for stats in (_stats(1), silent, _stats(3)):
        writer.write(stats)
    summary = summarize(read_metrics(metrics))
    assert (summary["first_loss"], summary["last_loss"], summary["no_loss_tokens"]) == (2.0, 2.0 / 3, 1)
    assert format_summary(summary).startswith("steps: 3 (last step 3), skipped (non-finite): 0, without loss tokens: 1")


@pytest.mark.parametrize("columns", [100, 0])
def test_a_real_pseudo_terminal_gets_the_bar(columns):
    """sys.stdout of a process on a pty: the bar's carriage-return redraws, not lines; also on a pty whose size
    nobody set (0 columns)."""
    script = (
        "from sft_trainer.progress import Progress\nfrom sft_trainer.train import StepStats\n"
        "p = Progress(3, 0, 1, True)\n"
        "for s in (1, 2, 3): p.update(StepStats(s, 1.0, 1, 1.0, 1e-3, 0.1, False, "
        "{'memory_gib': 0.5, 'tokens_per_s': 10.0}))\np.close()\n"
    )
    main_fd, child_fd = pty.openpty()
    if columns:
        fcntl.ioctl(child_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 30, columns, 0, 0))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=child_fd, stderr=child_fd, close_fds=True)
    os.close(child_fd)
    chunks = []
    while True:
        try:
            chunk = os.read(main_fd, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(main_fd)
    assert proc.wait(timeout=60) == 0
    text = b"".join(chunks).decode()
    assert "\r" in text and "3/3" in text and "loss 1.0000 | lr 1.00e-03" in text, text
    assert "step     1/3" not in text
    assert max(len(line) for line in re.split(r"[\r\n]", text)) <= (columns or 120)


# ---------------------------------------------------------------------------------------------------------
# sft-train report


def _write_metrics(run_dir: Path) -> list[dict]:
    records = []
    for step in range(1, 9):
        skipped = step == 5
        records.append(
            {
                "step": step,
                "loss": float("nan") if skipped else 3.0 - 0.2 * step + (0.5 if step == 7 else 0.0),
                "tokens": 500,
                "grad_norm": 1.0 / step,
                "lr": 1e-3 * min(1.0, step / 2),
                "step_time_s": 0.1 * step,
                "skipped": skipped,
                "memory_gib": 2.0 + (step % 3) / 10,
                "tokens_per_s": 1000.0 + 37.0 * (step % 4),
            }
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def test_report_writes_a_png_and_the_summary_numbers(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    records = _write_metrics(tmp_path / "run")
    report_main([str(tmp_path / "run")])
    text = capsys.readouterr().out
    png = tmp_path / "run" / "report.png"
    assert png.read_bytes()[:8] == PNG_SIGNATURE and png.stat().st_size > 10_000
    applied = [r["loss"] for r in records if not r["skipped"]]
    median = statistics.median(r["tokens_per_s"] for r in records)
    assert "steps: 8 (last step 8), skipped (non-finite): 1" in text
    assert f"loss: first {applied[0]:.4f}, last {applied[-1]:.4f}, min {min(applied):.4f}" in text
    assert f"tokens/s (median): {median:.0f}" in text and f"peak memory: {2.2:.2f} GiB" in text
    assert f"time in steps: {sum(0.1 * s for s in range(1, 9)):.1f} s" in text
    summary = summarize(read_metrics(tmp_path / "run" / "metrics.jsonl"))
    assert summary["min_loss"] == min(applied) and summary["last_loss"] == applied[-1] == 3.0 - 1.6
    assert summary["median_tokens_per_s"] == median and summary["peak_memory_gib"] == 2.2
    assert math.isclose(summary["step_time_s"], 3.6)


def test_report_of_a_missing_or_malformed_run_says_so_in_one_line(tmp_path):
    with pytest.raises(SystemExit) as missing:
        report_main([str(tmp_path / "nope")])
    assert str(missing.value.code) == f"sft-train report: {tmp_path / 'nope'}: no such run folder"
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as no_metrics:
        report_main([str(tmp_path / "empty")])
    assert "metrics.jsonl: no such file" in str(no_metrics.value.code)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss":\n')
    with pytest.raises(SystemExit) as malformed:
        report_main([str(tmp_path / "bad")])
    assert f"{tmp_path / 'bad' / 'metrics.jsonl'}:2: not a JSON object" in str(malformed.value.code)
    (tmp_path / "binary").mkdir()
    (tmp_path / "binary" / "metrics.jsonl").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(SystemExit) as binary:
        report_main([str(tmp_path / "binary")])
    assert "metrics.jsonl: not UTF-8 text (invalid start byte at byte 0), not a metrics.jsonl" in str(binary.value.code)
    for exc in (missing, no_metrics, malformed, binary):
        assert "\n" not in str(exc.value.code)
    proc = subprocess.run(
        [sys.executable, "-c", "from sft_trainer.cli import main; main()", "report", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and proc.stderr.strip().count("\n") == 0 and "no such run folder" in proc.stderr
    (tmp_path / "folder_as_metrics" / "metrics.jsonl").mkdir(parents=True)
    for given, said in (
        (tmp_path / "bad" / "metrics.jsonl", f"is a file; name the run folder that holds it ({tmp_path / 'bad'})"),
        (tmp_path / "folder_as_metrics", "metrics.jsonl: is a folder, not a metrics file"),
    ):
        with pytest.raises(SystemExit) as wrong:
            report_main([str(given)])
        assert said in str(wrong.value.code)


@pytest.mark.parametrize(
    "line,said",
    [
        ('{"step": 1e400, "loss": 1.0}', "step=Infinity: a step is a whole number >= 0"),
        ('{"step": true, "loss": 1.0}', "step=true: a step is a whole number >= 0"),
        ('{"step": 2.5, "loss": 1.0}', "step=2.5: a step is a whole number >= 0"),
        ('{"step": -1, "loss": 1.0}', "step=-1: a step is a whole number >= 0"),
        ('{"step": 1, "loss": false}', "loss=false: a loss is a number, or null for a step without loss tokens"),
        ('{"step": 1, "loss": "abc"}', 'loss="abc": a loss is a number, or null for a step without loss tokens'),
        ('{"loss": 1.0}', "no step; a record has a step and a loss"),
        ('{"step": 1}', "no loss; a record has a step and a loss"),
        ("[1, 2]", "needs a JSON object with a step and a loss, got [1, 2]"),
    ],
)
def test_report_refuses_a_record_whose_step_or_loss_breaks_the_rule(tmp_path, line, said):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n' + line + "\n")
    with pytest.raises(SystemExit) as refused:
        report_main([str(tmp_path)])
    assert refused.value.code == f"sft-train report: {tmp_path / 'metrics.jsonl'}:2: not a metrics record ({said})"


def test_report_counts_a_non_finite_loss_as_skipped_and_says_n_a_memory_without_a_unit(tmp_path):
    """The trainer skips a step whose loss is not finite (and writes NaN or Infinity for it): the summary counts it
    as skipped even where the record lacks its "skipped" mark, and leaves it out of the loss numbers."""
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 3.0}\n{"step": 2, "loss": NaN}\n{"step": 3, "loss": Infinity, "skipped": true}\n'
        '{"step": 4, "loss": 2.5}\n'
    )
    summary = summarize(read_metrics(tmp_path / "metrics.jsonl"))
    assert (summary["skipped"], summary["first_loss"], summary["last_loss"], summary["last_step"]) == (2, 3.0, 2.5, 4)
    assert format_summary(summary).splitlines() == [
        "steps: 4 (last step 4), skipped (non-finite): 2",
        "loss: first 3.0000, last 2.5000, min 2.5000",
        "tokens/s (median): n/a",
        "peak memory: n/a",
        "time in steps: 0.0 s",
    ]


# ---------------------------------------------------------------------------------------------------------
# One run, stdout a pipe: plain lines, the report at the end, and the offline wandb run's contents


def test_a_piped_run_prints_lines_writes_its_report_and_logs_to_wandb(tmp_path):
    pytest.importorskip("wandb")
    pytest.importorskip("matplotlib")
    out = tmp_path / "run"
    cmd = [sys.executable, "-c", "from sft_trainer.cli import main; main()", "--output_dir", str(out)]
    cmd += [
        "--train.steps",
        "3",
        "--train.warmup_steps",
        "1",
        "--data.seq_len",
        "128",
        "--checkpoint.export_hf",
        "false",
    ]
    cmd += ["--logging.wandb.enabled", "true", "--logging.wandb.project", "watchtest"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)  # stdout a pipe, as in logs or CI
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    expected = [
        f"step {m['step']:5d}/3 | loss {m['loss']:.4f} | tok/s {m['tokens_per_s']:9.0f} | "
        f"step {m['step_time_s'] * 1000:7.1f} ms | mem {m['memory_gib']:.2f} GiB"
        for m in metrics
    ]
    assert lines == expected, proc.stdout
    assert "\r" not in proc.stdout
    assert (out / "report.png").read_bytes()[:8] == PNG_SIGNATURE
    assert f"min {min(m['loss'] for m in metrics):.4f}" in proc.stdout

    runs = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    records = read_wandb_records(runs[0])
    kinds = [r.WhichOneof("record_type") for r in records]
    run = records[kinds.index("run")].run
    config = wandb_items(run.config.update)
    assert run.project == "watchtest"
    assert config["train"]["steps"] == 3 and config["data"]["seq_len"] == 128 and config["output_dir"] == str(out)
    history = [wandb_items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    assert [h["_step"] for h in history] == [1, 2, 3]
    for logged, written in zip(history, metrics, strict=True):
        for key, value in written.items():
            assert logged[key] == value, (key, logged, written)
    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update(wandb_items(r.summary.update))
    assert summary["_step"] == 3 and summary["loss"] == metrics[-1]["loss"]
    assert summary["tokens_per_s"] == metrics[-1]["tokens_per_s"]
    applied = [m["loss"] for m in metrics if not m["skipped"]]
    assert summary["run/steps"] == 3 and summary["run/skipped"] == len(metrics) - len(applied)
    assert summary["run/min_loss"] == min(applied) and summary["run/first_loss"] == applied[0]
    assert summary["run/median_tokens_per_s"] == statistics.median(m["tokens_per_s"] for m in metrics)
    assert summary["run/peak_memory_gib"] == max(m["memory_gib"] for m in metrics)
    assert "exit" in kinds


# ---------------------------------------------------------------------------------------------------------
# Under torchrun: the ranks watch each other's heartbeats through the rendezvous store


def _torchrun_workers(agent: int, timeout: float = 120) -> dict[int, int]:
    """rank -> pid of torchrun's workers (its children running sft_trainer.run), once both are up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ranks = {}
        for pid in map(int, Path(f"/proc/{agent}/task/{agent}/children").read_text().split()):
            env = dict(
                item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item
            )
            if "RANK" in env:
                ranks[int(env["RANK"])] = pid
        if len(ranks) == 2:
            return ranks
        time.sleep(0.2)
    raise AssertionError("torchrun's workers did not start")


def test_under_torchrun_a_frozen_rank_is_named_by_the_rank_that_waits(tmp_path):
    """torchrun, 2 gloo ranks, heartbeat 4 s: rank 1 is frozen (SIGSTOP) after its first step; rank 0 names it
    (rank, pid, host) in one line within the heartbeat timeout, ends it, and the job exits (no 30 s wait for
    torchrun's SIGKILL of a stopped process)."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "sft_trainer.run", "--output_dir", str(out), "--parallel.cp", "2", "--data.seq_len", "64",
           "--train.steps", "100000", "--train.warmup_steps", "0", "--logging.progress_bar", "false",
           "--checkpoint.export_hf", "false", "--parallel.heartbeat_timeout_s", "4"]  # fmt: skip
    run = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        workers = _torchrun_workers(run.pid)
        deadline = time.monotonic() + 180
        while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().count("\n") >= 1):
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()[1][-3000:]
            time.sleep(0.2)
        os.kill(workers[1], signal.SIGSTOP)
        frozen_at = time.monotonic()
        _, stderr = run.communicate(timeout=60)
        waited = time.monotonic() - frozen_at
    finally:
        if run.poll() is None:
            run.kill()
        for pid in workers.values() if "workers" in locals() else ():
            if Path(f"/proc/{pid}").exists():
                os.kill(pid, signal.SIGKILL)
    assert run.returncode != 0
    lines = [line for line in stderr.splitlines() if line.startswith("sft-train: ")]
    assert len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith(
        f"sft-train: rank 0: rank 1 (pid {workers[1]} on {socket.gethostname()}) stopped answering: no heartbeat for "
    ), lines
    assert "(parallel.heartbeat_timeout_s=4); stopping" in lines[0], lines
    assert waited < 4 + 12, waited  # the timeout, a beat, torchrun's shutdown, a margin for a loaded machine
    assert not Path(f"/proc/{workers[1]}").exists() or "Z" in Path(f"/proc/{workers[1]}/stat").read_text().split()[2]
    print(f"torchrun, frozen rank 1: job ended {waited:.1f} s after SIGSTOP")


def test_store_heartbeats_name_the_ranks_that_stopped_and_not_those_that_finished(monkeypatch):
    """This process as rank 0 of 3 beside two simulated ranks writing the store keys a torchrun worker writes:
    rank 1 beats then stops, rank 2 beats then says it is done. After a few seconds a collective timeout's line
    names rank 1 only; with the heartbeat off (0) nothing ends this process."""
    import datetime

    import torch.distributed as dist

    from sft_trainer import watchdog

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=30))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    watch = watchdog.PeerWatch()
    assert watch.peers_that_stopped() == "another rank stopped answering (frozen, stuck or dead)"
    prefix = watchdog._store_prefix()
    watch.start(0, 3, heartbeat_timeout_s=0)
    for _ in range(3):
        server.add(f"{prefix}1", 1)
        server.add(f"{prefix}2", 1)
        time.sleep(watchdog.BEAT_INTERVAL_S)
    server.set(f"{prefix}done/2", "1")
    time.sleep(watchdog.PEER_SILENT_S + 3 * watchdog.BEAT_INTERVAL_S)
    line = watch.peers_that_stopped()
    assert re.fullmatch(r"rank 1 stopped answering \(no heartbeat for [4-9] s\)", line), line
    assert server.add(f"{prefix}0", 0) >= 6  # this rank's own beats
    watch.stop()
    assert server.get(f"{prefix}done/0") == b"1"
