"""Nothing non-finite passes silently: config floats must be finite, a run whose loss or gradient stays non-finite
stops with one line, and the HF export refuses weights holding inf or nan."""

from __future__ import annotations

import json
import typing

import pytest
from faults import fault_env
from trainer_runs import one_line_failure, sft_train, worker_in_process

from sft_trainer.config import ConfigError, TrainConfig, load_config


def _float_fields() -> list[str]:
    """Every float-valued key of the config, by dotted name (betas as one array)."""
    names = []

    def walk(cls, prefix):
        for name, field in cls.model_fields.items():
            sub = field.annotation if isinstance(field.annotation, type) else None
            if sub is not None and hasattr(sub, "model_fields"):
                walk(sub, f"{prefix}{name}.")
            elif typing.get_origin(field.annotation) is not typing.Literal and "float" in str(field.annotation):
                names.append(f"{prefix}{name}")

    walk(TrainConfig, "")
    return names


def test_every_float_field_is_covered():
    assert sorted(_float_fields()) == [
        "parallel.collective_timeout_s",
        "parallel.heartbeat_timeout_s",
        "train.betas",
        "train.lora.alpha",
        "train.lora.dropout",
        "train.lr",
        "train.max_grad_norm",
        "train.min_lr_ratio",
        "train.weight_decay",
    ]


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
@pytest.mark.parametrize("key", _float_fields())
def test_non_finite_config_floats_are_refused(key, value):
    raw = f"[0.9, {value}]" if key == "train.betas" else value
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"--{key}", raw])
    shown = f"{key}[1]" if key == "train.betas" else key
    assert info.value.problems == [f"{shown}={float(value)!r}: must be a finite number (inf and nan are refused)"]


@pytest.mark.parametrize("key", ["train.seed", "data.seed"])
def test_seeds_are_refused_outside_0_to_2_63(key):
    for value, rule in ((2**63, "less than 9223372036854775808"), (-1, "greater than or equal to 0")):
        with pytest.raises(ConfigError, match=f"{key}={value}: Input should be {rule}"):
            load_config(None, [f"--{key}", str(value)])
    assert getattr(load_config(None, [f"--{key}", str(2**63 - 1)]), key.split(".")[0]).seed == 2**63 - 1


_RUN = ("--parallel.cp", "1", "--parallel.fsdp", "false", "--data.seq_len", "64", "--train.warmup_steps", "0",
        "--logging.progress_bar", "false", "--model.dtype", "float32")  # fmt: skip


def test_a_run_that_stays_non_finite_stops(tmp_path):
    """Every step's weights turn nan (an injected fault): each step is skipped, and the third in a row stops the
    run with one line; nothing is exported."""
    env = fault_env(tmp_path / "fault", "nan_weights")
    proc, seconds = sft_train("--output_dir", str(tmp_path / "out"), *_RUN, "--train.steps", "20", env=env)
    line = one_line_failure(proc)
    assert line == (
        "sft-train: the loss or gradient norm was not finite for 3 consecutive steps (steps 1-3, "
        "train.max_nonfinite_steps=3); lower train.lr, check the data, or resume from an earlier checkpoint"
    )
    records = [json.loads(r) for r in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in records] == [True, True, True]
    assert not (tmp_path / "out" / "hf").exists()
    print(f"non-finite stop: {seconds:.1f} s")


def test_the_export_refuses_non_finite_weights(tmp_path, monkeypatch, capfd):
    """The worker in this process (one rank; the fault and the one-line stop of a real process are the test
    above's): every weight turns nan before each step, the steps are skipped up to the limit, and at the end the
    export is refused while the checkpoint is kept."""
    import subprocess

    import torch

    import sft_trainer.run as run

    train_step = run.train_step

    def nan_weights(model, *args, **kwargs):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        return train_step(model, *args, **kwargs)

    monkeypatch.setattr(run, "train_step", nan_weights)
    out = tmp_path / "out"
    code = worker_in_process(
        monkeypatch,
        ["--output_dir", str(out), *_RUN, "--train.steps", "2", "--train.max_nonfinite_steps", "10",
         "--checkpoint.export_hf", "true"],
    )  # fmt: skip
    line = one_line_failure(subprocess.CompletedProcess([], code, "", capfd.readouterr().err))
    assert line.startswith(f"sft-train: not exporting to {out / 'hf'}: the weights hold inf or nan (")
    assert not (out / "hf" / "model.safetensors").exists()
    assert (out / "checkpoints" / "latest").read_text() == "step-000002"


def test_lr_above_1_is_refused():
    """An lr past fp32's range crashed AdamW's update; AdamW moves each weight by about lr a step, so > 1 is refused."""
    with pytest.raises(ConfigError, match=r"train\.lr=1e\+39: Input should be less than or equal to 1"):
        load_config(None, ["--train.lr", "1e39"])
