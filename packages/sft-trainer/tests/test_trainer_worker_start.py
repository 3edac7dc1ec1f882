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
import json, os, signal, sys

def probe(rank, out, beats):
    held = [name in sys.modules for name in ("sft_trainer.run", "torch.distributed.fsdp", "torch._dynamo", "transformers")]
    record = {"held": held, "probe": os.environ.get("SFT_PROBE"), "store": bool(os.environ.get("SFT_TRAIN_STORE")),
              "launcher": int(os.environ["SFT_TRAIN_LAUNCHER"]), "parent": os.getppid(),
              "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler
                        and signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])}
    with open(os.path.join(out, f"{rank}.json"), "w") as fh:
        json.dump(record, fh)
"""

_DRIVER = """
import os, sys
import signal
from sft_trainer.worker_start import WorkerStart
handler, mask = signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, [])  # as started
workers = WorkerStart()
assert workers.import_ahead() and workers.method == "forkserver"
from sft_trainer.worker_start import _fork_server
server = _fork_server()._forkserver_pid
ignored = int(next(l for l in open(f"/proc/{server}/status") if l.startswith("SigIgn:")).split()[1], 16)
assert ignored & (1 << (signal.SIGINT - 1)), "the server ignores SIGINT"
assert signal.getsignal(signal.SIGINT) is handler  # the launcher's own, back (ignored under `nohup ... &`)
assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask
os.environ["SFT_PROBE"] = "set after the server started"
from probe import probe
from sft_trainer.watchdog import run_workers
run_workers(probe, (os.path.join(sys.argv[1], "forked"),), 2, 30.0, start_method=workers.method)
workers.stop()
assert workers.method == "spawn"
run_workers(probe, (os.path.join(sys.argv[1], "spawned"),), 2, 30.0, start_method=workers.method)
print(os.getpid())
"""


def _python(code: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, env={**os.environ, **env}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_the_launcher_modules_before_the_check_import_no_torch():
    code = (
        "import sys, sft_trainer.cli, sft_trainer.worker_start; "
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    )
    assert _python(code).stdout.strip() == "[]"


def test_forked_workers_hold_their_imports_and_take_the_launchers_environment(tmp_path):
    """Workers forked by the server hold the trainer, FSDP2, torch._dynamo and transformers when they start (spawned
    ones do not), and both have the launcher's environment at their start, with the job's store and its pid, and
    Python's SIGINT handler, unblocked (the server ignores and blocks SIGINT)."""
    (tmp_path / "probe.py").write_text(_PROBE)
    for kind in ("forked", "spawned"):
        (tmp_path / kind).mkdir()
    proc = _python(
        _DRIVER, str(tmp_path), PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    )
    launcher = int(proc.stdout.split()[-1])
    for kind, held in (("forked", True), ("spawned", False)):
        for rank in (0, 1):
            record = json.loads((tmp_path / kind / f"{rank}.json").read_text())
            assert record["held"] == [held] * 4, (kind, record)
            # the environment at the workers' start, not the server's (started before SFT_PROBE was set)
            assert record["probe"] == "set after the server started" and record["store"], (kind, record)
            assert record["launcher"] == launcher and record["sigint"], (kind, record)
            assert (record["parent"] == launcher) == (kind == "spawned"), (kind, record)  # forked: the server's


# Runs a refused config through the CLI while a thread notes every fork server this process starts.
_REFUSED = """
import os, sys, threading, time
from pathlib import Path
servers, done = set(), threading.Event()
SERVER = b"from multiprocessing.fork" + b"server import main"  # split: a child not yet exec'd shows this code

def watch():
    while not done.is_set():
        for pid in Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split():
            try:
                if SERVER in Path(f"/proc/{pid}/cmdline").read_bytes():
                    servers.add(int(pid))
            except OSError:
                pass
        time.sleep(0.005)

threading.Thread(target=watch, daemon=True).start()
from sft_trainer.cli import main
try:
    main(["--output_dir", sys.argv[1], "--parallel.cp", "3"])
except SystemExit as exc:
    print(exc.code, file=sys.stderr)
done.set()
print(len(servers), sum(os.path.exists(f"/proc/{pid}") for pid in servers))
"""


def test_a_refused_config_ends_the_fork_server(tmp_path):
    proc = _python(_REFUSED, str(tmp_path / "out"))
    assert "sft-train: invalid config" in proc.stderr and "parallel.cp=3" in proc.stderr, proc.stderr
    assert proc.stdout.split() == ["1", "0"], proc.stdout  # one server started, then ended and reaped
    assert not Path(tmp_path / "out").exists()


# A Python whose multiprocessing keeps its fork server elsewhere (simulated in this throwaway interpreter).
_OTHER_INTERNALS = """
import os, sys
from multiprocessing import forkserver
forkserver._forkserver = object()
from sft_trainer.worker_start import WorkerStart
workers = WorkerStart()
print(workers.import_ahead(), workers.method)
from probe import probe
from sft_trainer.watchdog import run_workers
run_workers(probe, (sys.argv[1],), 2, 30.0, start_method=workers.method)
"""


def test_a_python_with_other_fork_server_internals_spawns(tmp_path):
    (tmp_path / "probe.py").write_text(_PROBE)
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = _python(_OTHER_INTERNALS, str(tmp_path), **env)
    assert proc.stdout.split() == ["False", "spawn"], proc.stdout
    for rank in (0, 1):
        record = json.loads((tmp_path / f"{rank}.json").read_text())
        assert record["held"] == [False] * 4 and record["parent"] == record["launcher"], record
