"""Output paths that refuse writes even to root: a folder to create inside a kernel file system (/proc, /sys:
mkdir fails there for every user, though os.access says yes to root), and an existing metrics file that refuses
appends. Each of ``output_dir``, ``checkpoint.dir`` and ``logging.metrics_file`` gets its one line in ``main``,
before any worker starts."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from sft_trainer import run
from sft_trainer.cli import main

KERNEL_FOLDERS = ("/proc", "/sys")


def _refuses_entries(folder: str) -> bool:
    """Whether this machine refuses a new folder in ``folder`` (tried: the case the test needs)."""
    probe = Path(folder) / "sft-train-unwritable-probe"
    try:
        probe.mkdir()
    except OSError:
        return True
    probe.rmdir()
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and /sys are Linux's")
@pytest.mark.parametrize("kernel_folder", KERNEL_FOLDERS)
def test_each_output_path_in_a_folder_that_refuses_writes_gets_one_line_before_launch(
    tmp_path, monkeypatch, kernel_folder
):
    if not _refuses_entries(kernel_folder):
        pytest.skip(f"{kernel_folder} accepts new entries on this machine")
    monkeypatch.setattr(run, "launch", lambda cfg, workers=None: pytest.fail("a worker was launched"))
    target = f"{kernel_folder}/sft-train-out/sub"
    checked = []
    for field in ("output_dir", "checkpoint.dir", "logging.metrics_file"):
        args = [] if field == "output_dir" else ["--output_dir", str(tmp_path / "out")]
        with pytest.raises(SystemExit) as info:
            main([*args, f"--{field}", target])
        lines = str(info.value.code).splitlines()
        assert len(lines) == 1, lines
        assert lines[0].startswith(f"sft-train: {field}={target!r}: "), lines
        assert f"cannot be created (in {kernel_folder}: " in lines[0] and "choose a writable path" in lines[0]
        checked.append(field)
    assert checked == ["output_dir", "checkpoint.dir", "logging.metrics_file"]
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not os.path.exists("/proc/version"), reason="no /proc/version to stand for a read-only file")
def test_an_existing_metrics_file_that_refuses_appends_gets_one_line(tmp_path, monkeypatch):
    try:
        with open("/proc/version", "ab"):
            pytest.skip("/proc/version accepts appends on this machine")
    except OSError:
        pass
    monkeypatch.setattr(run, "launch", lambda cfg, workers=None: pytest.fail("a worker was launched"))
    with pytest.raises(SystemExit) as info:
        main(["--output_dir", str(tmp_path / "out"), "--logging.metrics_file", "/proc/version"])
    line = str(info.value.code)
    assert line.startswith("sft-train: logging.metrics_file='/proc/version': /proc/version is not writable ("), line
    assert "\n" not in line
