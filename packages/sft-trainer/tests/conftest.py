"""Test-session settings shared by the sft-trainer tests."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _token_cache(tmp_path_factory: pytest.TempPathFactory):
    """The token cache of every run in the session (workers inherit it) lives in a temporary folder, not ~/.cache."""
    previous = os.environ.get("SFT_TRAINER_CACHE")
    os.environ["SFT_TRAINER_CACHE"] = str(tmp_path_factory.mktemp("token-cache"))
    yield
    if previous is None:
        os.environ.pop("SFT_TRAINER_CACHE", None)
    else:
        os.environ["SFT_TRAINER_CACHE"] = previous


@pytest.fixture(scope="session")
def cp1_run(tmp_path_factory):
    """The reference run of the tiny Qwen3.5 (one process, a full replica, no FSDP, two rows accumulated per step,
    the shipped config) and its metrics; its HF export is also the checkpoint the LoRA tests start from."""
    from trainer_runs import _train

    out = tmp_path_factory.mktemp("cp1")
    overrides = (
        "--parallel.cp",
        "1",
        "--parallel.dp",
        "1",
        "--parallel.fsdp",
        "false",
        "--checkpoint.export_hf",
        "true",
    )
    return out, _train(out, *overrides)


@pytest.fixture(scope="session")
def nemotron_runs(tmp_path_factory) -> dict[str, tuple]:
    """The tiny Nemotron-H trained at cp = 1 (one process, no FSDP) and at cp = 2 under each Mamba strategy
    (state passing, head-parallel a2a), in one launcher: name -> (output folder, metrics). The cp = 1 run's HF
    export is also the Nemotron-H checkpoint that test_trainer_checkpoints trains again."""
    from trainer_runs import _train_runs

    out = tmp_path_factory.mktemp("nemotron_h")
    nemotron = ("--model.preset", "tiny-nemotron_h")
    runs = {
        "cp1": (*nemotron, "--parallel.cp", "1", "--parallel.fsdp", "false"),
        "state_passing": (*nemotron, "--parallel.cp", "2", "--parallel.cp_style", "state_passing"),
        "a2a": (*nemotron, "--parallel.cp", "2", "--parallel.cp_style", "a2a"),
    }
    metrics = _train_runs(*((out / name, overrides) for name, overrides in runs.items()))
    return {name: (out / name, m) for name, m in zip(runs, metrics, strict=True)}


@pytest.fixture(scope="session")
def vl_runs(tmp_path_factory) -> dict[str, tuple]:
    """The tiny Qwen3.5-VL (``--config tiny_vl_cpu``) at cp = 1 (one process, no FSDP) and at cp = 2 with FSDP in
    each vision mode (the tower sharded or replicated), in one launcher: name -> (output folder, metrics). The cp = 1
    run's HF export is also the VL checkpoint that test_trainer_checkpoints trains again."""
    from trainer_runs import _train_runs

    out = tmp_path_factory.mktemp("vl")
    vl = ("--config", "tiny_vl_cpu")
    runs = {
        "cp1": (*vl, "--parallel.cp", "1", "--parallel.fsdp", "false"),
        "shard": (*vl, "--parallel.cp", "2", "--model.vision_cp", "shard"),
        "replicate": (*vl, "--parallel.cp", "2", "--model.vision_cp", "replicate"),
    }
    metrics = _train_runs(*((out / name, overrides) for name, overrides in runs.items()))
    return {name: (out / name, m) for name, m in zip(runs, metrics, strict=True)}
