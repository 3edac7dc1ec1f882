"""Nothing in a checkpoint folder runs code: crafted pickles where sft-train's state, DCP's metadata or the
optimizer's non-tensor items live are refused with one line, and the code in them never executes."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_trainer_outputs import fake_checkpoint

from sft_trainer.checkpoint import CheckpointError, _dcp_reader_and_planner, check_resume, read_dcp_metadata
from sft_trainer.cli import main
from sft_trainer.config import load_config


class _Touch:
    """Unpickling this creates ``marker``: the proof that a load ran code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _payload(marker: Path) -> bytes:
    return pickle.dumps({"step": 1, "scheduler": {}, "rng": _Touch(marker)})


def _sft_train(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", "from sft_trainer.cli import main; main()", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc, time.monotonic() - started


# The case run as a whole sft-train process (exit code, stderr, no traceback); the others call main in this process,
# which stops with the same message before any worker starts.
REAL_PROCESS_CASE = ".metadata"


@pytest.mark.parametrize("where", ["extra-rank0.pt", "extra-rank0.json", "rng-rank0.safetensors", ".metadata"])
def test_a_crafted_pickle_in_a_resume_folder_does_not_run(tmp_path, where):
    """A resume folder where one file is a pickle that would create a file when unpickled: the run stops before any
    worker starts, with one line naming the file, and the file is never created."""
    ckpt = fake_checkpoint(tmp_path / "ckpt", step=1, ranks=2, train_steps=3, grad_accum=1)  # tiny_cpu: cp 2
    marker = tmp_path / "pwned"
    if where == "extra-rank0.pt":  # a pickle beside no JSON state: the layout of torch.save'd extras
        (ckpt / "extra-rank0.json").unlink()
    (ckpt / where).write_bytes(_payload(marker))
    args = ("--output_dir", str(tmp_path / "out"), "--checkpoint.resume", str(ckpt), "--train.steps", "3",
            "--train.grad_accum", "1", "--train.warmup_steps", "1")  # fmt: skip
    if where == REAL_PROCESS_CASE:
        proc, seconds = _sft_train(*args)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        message = proc.stderr
    else:
        started = time.monotonic()
        with pytest.raises(SystemExit) as info:
            main(list(args))
        seconds = time.monotonic() - started
        message = str(info.value.code)
    assert not marker.exists()
    lines = message.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sft-train: cannot resume: checkpoint.resume: "), message
    expected = {
        "extra-rank0.pt": "(it holds extra-rank0.pt, a pickle, which sft-train never loads)",
        "extra-rank0.json": "extra-rank0.json: not readable as sft-train's JSON state",
        "rng-rank0.safetensors": "rng-rank0.safetensors: not a readable safetensors file",
        ".metadata": ".metadata: not torch DCP checkpoint metadata (UnpicklingError: refused global posix.system)",
    }[where]
    assert expected in lines[0], lines[0]
    assert seconds < 30  # before any worker: no process group, no model
    assert not (tmp_path / "out").exists()


def test_dcp_metadata_reads_through_the_allow_list(tmp_path):
    """A real DCP checkpoint's metadata reads (tensors of several dtypes, bytes items); a missing one is named."""
    import torch.distributed.checkpoint as dcp

    dcp.save(
        {"a": torch.ones(2, dtype=torch.bfloat16), "b": torch.zeros(3), "c": {"lr": 0.1}}, checkpoint_id=str(tmp_path)
    )
    metadata = read_dcp_metadata(tmp_path)
    assert sorted(metadata.state_dict_metadata) == ["a", "b", "c.lr"]
    (tmp_path / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"\.metadata is missing \(an incomplete checkpoint"):
        read_dcp_metadata(tmp_path)


def test_optimizer_items_load_weights_only(tmp_path):
    """The optimizer's non-tensor items (DCP stores them as pickled bytes) load with torch.load(weights_only=True):
    plain values come back, a crafted object raises and runs nothing."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    _reader, planner = _dcp_reader_and_planner(tmp_path)
    planner.flatten_state_dict, planner.state_dict = False, {}
    item = ReadItem(LoadItemType.BYTE_IO, MetadataIndex("lr"), torch.Size(), MetadataIndex("lr"), torch.Size(), [1])
    buffer = io.BytesIO()
    torch.save({"lr": 0.25, "betas": (0.9, 0.95)}, buffer)
    buffer.seek(0)
    planner.load_bytes(item, buffer)
    assert planner.state_dict["lr"] == {"lr": 0.25, "betas": (0.9, 0.95)}
    marker = tmp_path / "pwned"
    buffer = io.BytesIO()
    torch.save({"lr": _Touch(marker)}, buffer)
    buffer.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(item, buffer)
    assert not marker.exists()


def test_a_checkpoint_missing_a_rank_or_metadata_is_named(tmp_path):
    ckpt = fake_checkpoint(tmp_path / "ckpt", step=1, ranks=2, train_steps=40)
    cfg = load_config(None, ["--checkpoint.resume", str(ckpt)])
    (ckpt / "rng-rank1.safetensors").write_bytes(b"\x00" * 7)  # truncated
    assert check_resume(cfg, world=2) == [
        f"checkpoint.resume: {ckpt / 'rng-rank1.safetensors'}: not a readable safetensors file "
        "(Error while deserializing header: header too small)"
    ]
    (ckpt / "extra-rank1.json").unlink()
    assert check_resume(cfg, world=2) == [
        f"checkpoint.resume: {ckpt} is incomplete: extra-rank1.json missing (resume from an earlier step)"
    ]
    ckpt = fake_checkpoint(tmp_path / "ckpt2", step=1, ranks=2, train_steps=40)
    cfg = load_config(None, ["--checkpoint.resume", str(ckpt)])
    shard = next(ckpt.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:3])
    assert check_resume(cfg, world=2) == [
        f"checkpoint.resume: {ckpt} is incomplete: {shard.name} truncated (resume from an earlier step)"
    ]
    shard.unlink()
    assert check_resume(cfg, world=2) == [
        f"checkpoint.resume: {ckpt} is incomplete: {shard.name} missing (resume from an earlier step)"
    ]
