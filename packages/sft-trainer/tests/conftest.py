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
