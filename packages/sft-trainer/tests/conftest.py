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
