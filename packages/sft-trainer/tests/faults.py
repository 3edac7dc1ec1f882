"""Faults injected into ``sft-train`` subprocesses (every spawned worker too): a ``sitecustomize`` on PYTHONPATH
that patches the trainer when ``SFT_FAULT`` names a fault, so that tests replay failures no input can cause."""

from __future__ import annotations

import os
from pathlib import Path

_SITECUSTOMIZE = """
import os

_fault = os.environ.get("SFT_FAULT", "")
if _fault:
    import errno

    import torch

    import sft_trainer.checkpoint as checkpoint
    import sft_trainer.run as run

    if _fault == "nan_weights":  # every weight becomes nan before each step: every loss is nan
        _train_step = run.train_step

        def train_step(model, *args, **kwargs):
            with torch.no_grad():
                for p in model.parameters():
                    (p.to_local() if hasattr(p, "to_local") else p).fill_(float("nan"))
            return _train_step(model, *args, **kwargs)

        run.train_step = train_step
    elif _fault.startswith("sigkill_rank1_at_step_"):  # rank 1 dies (SIGKILL) as this step starts
        _train_step, _calls, _step = run.train_step, [0], int(_fault.rsplit("_", 1)[1])

        def train_step(*args, **kwargs):
            _calls[0] += 1
            if _calls[0] == _step and os.environ.get("RANK") == "1":
                import signal

                os.kill(os.getpid(), signal.SIGKILL)
            return _train_step(*args, **kwargs)

        run.train_step = train_step
    elif _fault.startswith("enospc_at_step_"):  # the disk fills while this step's checkpoint is written
        _write = checkpoint.write_extra_state
        _step = int(_fault.rsplit("_", 1)[1])

        def write_extra_state(path, rank, state, rng):
            if state["step"] == _step:
                (path / "partial.bin").write_bytes(b"x" * 1000)
                raise OSError(errno.ENOSPC, "No space left on device", str(path / "partial.bin"))
            return _write(path, rank, state, rng)

        checkpoint.write_extra_state = write_extra_state
"""


def fault_env(folder: Path, fault: str) -> dict[str, str]:
    """The environment of an ``sft-train`` run with ``fault`` injected (``folder`` receives the sitecustomize)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "SFT_FAULT": fault}
