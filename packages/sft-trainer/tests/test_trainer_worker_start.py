"""Local workers forked by the fork server that imports their modules while the launcher checks the config
(sft_trainer.worker_start): what they hold when they start, the environment they get, and no server left behind
when the config is refused. Each case runs in a fresh interpreter (this one has torch imported already)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# A worker target for watchdog.run_workers: what this worker holds at its start, before it imports anything.
_PROBE = """
import json, os, sys

def probe(rank, out, beats, environ, launcher):
    held = {name: name in sys.modules for name in ("torch", "torch.distributed.fsdp", "torch._dynamo", "transformers")}
    record = {"held": held, "probe": environ.get("SFT_PROBE"), "store": bool(environ.get("SFT_TRAIN_STORE")),
              "launcher": launcher, "own_probe": os.environ.get("SFT_PROBE")}
    with open(os.path.join(out, f"{rank}.json"), "w") as fh:
        json.dump(record, fh)
"""

_DRIVER = """
import os, sys
from sft_trainer import worker_start
assert worker_start.import_ahead() and worker_start.start_method() == "forkserver"
os.environ["SFT_PROBE"] = "set after the server started"
from probe import probe
from sft_trainer.watchdog import run_workers
run_workers(probe, (sys.argv[1],), 2, 30.0)
print(os.getpid())
"""


def _python(code: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, env={**os.environ, **env}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_the_launcher_modules_before_the_check_import_no_torch():
    code = "import sys, sft_trainer.cli, sft_trainer.worker_start; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    assert _python(code).stdout.strip() == "[]"


def test_forked_workers_hold_their_imports_and_take_the_launchers_environment(tmp_path):
    (tmp_path / "probe.py").write_text(_PROBE)
    out = tmp_path / "out"
    out.mkdir()
    proc = _python(_DRIVER, str(out), PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    launcher = int(proc.stdout.split()[-1])
    for rank in (0, 1):
        record = json.loads((out / f"{rank}.json").read_text())
        assert record["held"] == dict.fromkeys(
            ("torch", "torch.distributed.fsdp", "torch._dynamo", "transformers"), True
        )
        # the environment at the workers' start, not the server's (started before SFT_PROBE was set)
        assert record["probe"] == "set after the server started" and record["store"]
        assert record["own_probe"] is None  # run._spawned applies `environ`; the probe only reports what it got
        assert record["launcher"] == launcher


_REFUSED = """
import os, sys
from multiprocessing import forkserver
started = []
_ensure_running = forkserver.ensure_running

def ensure_running():
    _ensure_running()
    started.append(forkserver._forkserver._forkserver_pid)

forkserver.ensure_running = ensure_running
from sft_trainer.cli import main
try:
    main(["--output_dir", sys.argv[1], "--parallel.cp", "3"])
except SystemExit as exc:
    print(exc.code, file=sys.stderr)
print(started, [os.path.exists(f"/proc/{pid}") for pid in started])
"""


def test_a_refused_config_ends_the_fork_server(tmp_path):
    proc = _python(_REFUSED, str(tmp_path / "out"))
    assert "sft-train: invalid configuration:" in proc.stderr and "parallel.cp=3" in proc.stderr, proc.stderr
    started, alive = proc.stdout.strip().split("] [")
    assert started != "[" and alive == "False]", proc.stdout  # one server, started, then ended and reaped
    assert not Path(tmp_path / "out").exists()
