"""What a run does with the folders of earlier runs: resuming checks, and a fresh run setting old outputs aside."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from sft_trainer.checkpoint import check_resume, read_extra_state, resume_checkpoint, rng_state, write_extra_state
from sft_trainer.cli import main
from sft_trainer.config import load_config, tiny_qwen35_config
from sft_trainer.run_folder import output_problems, set_aside_previous_run


def fake_checkpoint(folder: Path, step: int, ranks: int, train_steps: int = 40, grad_accum: int = 2) -> Path:
    """The files of an sft-train checkpoint at ``step`` written by ``ranks`` ranks (a one-tensor DCP state)."""
    import torch.distributed.checkpoint as dcp

    path = folder / f"step-{step:06d}"
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"x": torch.zeros(1)}, checkpoint_id=str(path))
    state = {"step": step, "train_steps": train_steps, "grad_accum": grad_accum, "data_position": 0, "scheduler": {},
             "world_size": ranks}  # fmt: skip
    for rank in range(ranks):
        write_extra_state(path, rank, state, rng_state())
    (folder / "latest").write_text(path.name)
    return path


def test_resume_checks_name_the_step_the_layout_and_a_foreign_folder(tmp_path):
    ckpt = fake_checkpoint(tmp_path / "out" / "checkpoints", step=14, ranks=2)
    base = ["--output_dir", str(tmp_path / "out"), "--checkpoint.resume", "true"]
    cfg = load_config(None, base)
    assert resume_checkpoint(cfg) == ckpt
    assert cfg.train.steps == 40 and check_resume(cfg, world=2) == []  # a checkpoint this run can continue
    assert check_resume(cfg, world=4) == [
        f"checkpoint.resume: {ckpt} was written by 2 rank(s) and this run has 4 (dp x cp); resume with the layout "
        "that wrote it, or start fresh (checkpoint.resume = false)",
    ]
    cfg = load_config(None, [*base, "--train.steps", "5", "--train.warmup_steps", "1", "--train.grad_accum", "1"])
    assert check_resume(cfg, world=2) == [
        f"checkpoint.resume: {ckpt} was trained with train.steps=40 and this run sets train.steps=5, which would "
        "change its learning-rate schedule; resume with train.steps=40, or start a new run from its HF export "
        "(model.path)",
        f"checkpoint.resume: {ckpt} was trained with train.grad_accum=2 and this run sets 1, which would change the "
        "data order; resume with train.grad_accum=2",
        f"checkpoint.resume: {ckpt} is at step 14, past train.steps=5",
    ]
    with pytest.raises(SystemExit, match=r"sft-train: cannot resume:\n  - checkpoint\.resume: .* train\.steps=40"):
        main(["--output_dir", str(tmp_path / "out"), "--checkpoint.resume", "latest", "--train.steps", "13"])
    other = tmp_path / "other"
    other.mkdir()
    cfg = load_config(None, ["--checkpoint.resume", str(other)])
    assert check_resume(cfg, world=2) == [
        f"checkpoint.resume: {other} is not an sft-train checkpoint (no extra-rank0.json in it)"
    ]
    # a rank's state from another save: the ranks would resume at different steps
    mixed = fake_checkpoint(tmp_path / "mixed", step=14, ranks=2)
    stale = read_extra_state(mixed, 1)
    write_extra_state(mixed, 1, {**stale, "step": 12}, rng_state())
    cfg = load_config(None, ["--checkpoint.resume", str(mixed), "--train.steps", "40"])
    assert check_resume(cfg, world=2) == [
        f"checkpoint.resume: {mixed} is inconsistent: extra-rank1.json has step=12 and extra-rank0.json step=14; "
        "resume from another step"
    ]
    # a latest file that is not text: one line
    (tmp_path / "out" / "checkpoints" / "latest").write_bytes(b"\xff\xfe")
    cfg = load_config(None, base)
    assert check_resume(cfg, world=2) == [
        f"checkpoint.resume: {tmp_path / 'out' / 'checkpoints' / 'latest'}: not readable as the name of a step folder "
        "(UnicodeDecodeError); write the step-NNNNNN folder to resume into it, or name that folder in "
        "checkpoint.resume"
    ]
    # true with no checkpoint yet: a fresh start, nothing to check
    cfg = load_config(None, ["--output_dir", str(tmp_path / "empty"), "--checkpoint.resume", "true"])
    assert resume_checkpoint(cfg) is None and check_resume(cfg, world=2) == []


def test_resume_refuses_optimizer_settings_the_saved_state_would_override(tmp_path):
    """AdamW's param groups come back as saved: a resume that sets another lr, betas or weight decay is refused
    (from the recorded settings, or for older checkpoints the schedule's base lr), not silently ignored."""
    ckpt = fake_checkpoint(tmp_path / "out" / "checkpoints", step=4, ranks=1)
    base = ["--output_dir", str(tmp_path / "out"), "--checkpoint.resume", "true", "--parallel.cp", "1"]
    train = load_config(None, base).train
    recorded = {"lr": train.lr, "betas": list(train.betas), "weight_decay": train.weight_decay}
    extra = json.loads((ckpt / "extra-rank0.json").read_text())
    (ckpt / "extra-rank0.json").write_text(json.dumps({**extra, "optimizer": recorded}))
    assert check_resume(load_config(None, base), world=1) == []
    changed = load_config(None, [*base, "--train.lr", "1e-4", "--train.weight_decay", "0.5"])
    assert check_resume(changed, world=1) == [
        f"checkpoint.resume: {ckpt} was trained with train.lr={train.lr}, train.weight_decay={train.weight_decay} "
        "and this run sets train.lr=0.0001, train.weight_decay=0.5, which the optimizer's saved state would "
        f"override; resume with train.lr={train.lr}, train.weight_decay={train.weight_decay}, or start a new run "
        "from its HF export (model.path)"
    ]
    # a checkpoint without the record: its schedule's base lr
    (ckpt / "extra-rank0.json").write_text(json.dumps({**extra, "scheduler": {"base_lrs": [train.lr]}}))
    assert len(check_resume(changed, world=1)) == 1 and "train.lr=0.0001" in check_resume(changed, world=1)[0]
    assert check_resume(load_config(None, [*base, "--train.weight_decay", "0.5"]), world=1) == []


def test_resume_refuses_another_layout_or_schedule_at_the_same_rank_count(tmp_path):
    """dp x cp at the same rank count hands each rank other rows, and warmup, decay and the floor shape the LR of
    every step left: a resume that changes them is refused (a checkpoint that records neither passes)."""
    ckpt = fake_checkpoint(tmp_path / "out" / "checkpoints", step=4, ranks=2)
    base = ["--output_dir", str(tmp_path / "out"), "--checkpoint.resume", "true"]
    cfg = load_config(None, base)
    assert cfg.parallel.cp == 2 and check_resume(cfg, world=2) == []  # no record: as before
    recorded = {
        "layout": {"dp": 1, "cp": 2},
        "schedule": {"warmup_steps": cfg.train.warmup_steps, "decay": "cosine", "min_lr_ratio": 0.1},
    }
    for rank in (0, 1):
        extra = json.loads((ckpt / f"extra-rank{rank}.json").read_text())
        (ckpt / f"extra-rank{rank}.json").write_text(json.dumps({**extra, **recorded}))
    assert check_resume(cfg, world=2) == []
    swapped = load_config(None, [*base, "--parallel.cp", "1", "--parallel.dp", "2"])
    assert check_resume(swapped, world=2) == [
        f"checkpoint.resume: {ckpt} was trained with parallel.dp=1, parallel.cp=2 and this run sets parallel.dp=2, "
        "parallel.cp=1, which would change which rows each rank reads; resume with parallel.dp=1, parallel.cp=2, or "
        "start a new run from its HF export (model.path)"
    ]
    rescheduled = load_config(None, [*base, "--train.decay", "linear", "--train.min_lr_ratio", "0.5"])
    assert check_resume(rescheduled, world=2) == [
        f"checkpoint.resume: {ckpt} was trained with train.decay='cosine', train.min_lr_ratio=0.1 and this run sets "
        "train.decay='linear', train.min_lr_ratio=0.5, which would change its learning-rate schedule; resume with "
        "train.decay='cosine', train.min_lr_ratio=0.1, or start a new run from its HF export (model.path)"
    ]


def test_an_export_over_the_model_it_trains_from_is_refused(tmp_path):
    out = tmp_path / "out"
    (out / "hf").mkdir(parents=True)
    cfg = load_config(None, ["--output_dir", str(out)])  # then model.path as a continued run would name it
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(out / "hf"), "preset": None})})
    assert output_problems(cfg) == [
        f"model.path={str(out / 'hf')!r} is where this run exports its weights ({out / 'hf'}): the export would "
        "overwrite the model it trains from; set another output_dir, or copy the model elsewhere first"
    ]
    no_export = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"export_hf": False})})
    assert output_problems(no_export) == []


def test_a_fresh_run_sets_an_earlier_run_aside(tmp_path, capsys):
    out = tmp_path / "out"
    cfg = load_config(None, ["--output_dir", str(out)])
    assert set_aside_previous_run(cfg) == []  # nothing there yet
    (out / "hf").mkdir(parents=True)
    (out / "hf" / "config.json").write_text("{}")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    fake_checkpoint(out / "checkpoints", step=40, ranks=2)
    (out / "notes.txt").write_text("mine")  # not a run output: stays
    moves = set_aside_previous_run(cfg)
    assert sorted(new.name for _, new in moves) == ["checkpoints.1", "hf.1", "metrics.1.jsonl"]
    assert (out / "checkpoints.1" / "step-000040" / "extra-rank1.json").is_file()
    assert (out / "metrics.1.jsonl").read_text() == '{"step": 1}\n' and (out / "hf.1" / "config.json").is_file()
    assert not (out / "checkpoints").exists() and (out / "notes.txt").read_text() == "mine"
    assert "an earlier run's outputs were here; moved aside" in capsys.readouterr().out
    # nested or shared folders: only the outermost moves, never the run folder itself or what the run reads
    (out / "hf.1" / "config.json").write_text(json.dumps(tiny_qwen35_config().to_dict()))
    nested = load_config(None, ["--output_dir", str(out), "--checkpoint.dir", str(out), "--logging.metrics_file",
                                str(out / "checkpoints.1" / "m.jsonl"), "--model.config", str(out / "hf.1")])  # fmt: skip
    (out / "checkpoints.1" / "m.jsonl").write_text("{}\n")
    (out / "hf").mkdir()
    (out / "hf" / "x").write_text("x")
    moves = [(old.name, new.name) for old, new in set_aside_previous_run(nested)]
    assert moves == [("m.jsonl", "m.2.jsonl"), ("hf", "hf.2")]  # not out itself (the checkpoints' folder here)
    assert (out / "checkpoints.1" / "m.2.jsonl").is_file() and (out / "hf.1" / "config.json").is_file()
    # the next one takes the next free number; empty leftovers are not a run
    (out / "metrics.jsonl").write_text('{"step": 2}\n')
    (out / "checkpoints").mkdir()
    assert [new.name for _, new in set_aside_previous_run(cfg)] == ["metrics.2.jsonl"]


def test_a_resumed_run_keeps_one_metrics_record_per_step(tmp_path):
    """A run crashed after step 5 and resumed from the checkpoint of step 3: the records of steps 4 and 5 (and a
    line cut by the crash) go, the replayed steps are written once."""
    from sft_trainer.train import MetricsWriter, StepStats

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 6)) + '{"step": 6, "lo')
    writer = MetricsWriter(path, fresh=False, resumed_at=3)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    for step in (4, 5):
        writer.write(StepStats(step, 0.5, 10, 1.0, 1e-3, 0.1))
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4, 5]
    MetricsWriter(path, fresh=True)
    assert path.read_text() == ""
