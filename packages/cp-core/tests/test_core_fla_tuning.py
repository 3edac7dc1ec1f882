"""cp_core.fla_tuning: which folder of fla kernel configs a process uses, and when it leaves fla alone (CPU)."""

import os
import sys

import pytest
import torch

from cp_core import fla_tuning
from cp_core.fla_tuning import TUNING_DIR_ENV, fla_tuning_dir, gpu_folder_name, use_fla_tuning


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("FLA_CONFIG_DIR", "FLA_CACHE_MODE", TUNING_DIR_ENV):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_gpu_folder_name_spells_the_device_as_fla_does():
    assert gpu_folder_name("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3"
    assert gpu_folder_name("NVIDIA H200") == "NVIDIA_H200"
    assert gpu_folder_name(" --- ") == "unknown_gpu"


def test_the_users_folder_comes_first(clean_env, tmp_path):
    clean_env.setenv(TUNING_DIR_ENV, str(tmp_path))
    assert fla_tuning_dir() == tmp_path
    if "fla" in sys.modules:
        pytest.skip("fla is imported in this process")
    assert use_fla_tuning() == tmp_path
    assert os.environ["FLA_CONFIG_DIR"] == str(tmp_path)
    assert os.environ["FLA_CACHE_MODE"] == "strict"


def test_no_folder_without_a_gpu_or_a_shipped_one(clean_env, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert fla_tuning_dir() is None
    assert use_fla_tuning() is None
    assert "FLA_CONFIG_DIR" not in os.environ and "FLA_CACHE_MODE" not in os.environ


def test_the_shipped_folder_is_found_by_the_gpu_name(clean_env, monkeypatch, tmp_path):
    (tmp_path / "NVIDIA_H100_80GB_HBM3").mkdir()
    monkeypatch.setattr(fla_tuning, "SHIPPED_TUNING", tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert fla_tuning_dir() == tmp_path / "NVIDIA_H100_80GB_HBM3"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A10G")
    assert fla_tuning_dir() is None


@pytest.mark.parametrize("name,value", [("FLA_CACHE_MODE", "disabled"), ("FLA_CONFIG_DIR", "/elsewhere")])
def test_fla_settings_of_the_user_are_kept(clean_env, tmp_path, name, value):
    clean_env.setenv(TUNING_DIR_ENV, str(tmp_path))
    clean_env.setenv(name, value)
    assert use_fla_tuning() is None
    assert os.environ[name] == value
    other = "FLA_CONFIG_DIR" if name == "FLA_CACHE_MODE" else "FLA_CACHE_MODE"
    assert other not in os.environ


def test_shipped_folders_hold_fla_config_files():
    """Every shipped file is one kernel's entries in fla's layout: a key hash -> the key and a full config."""
    import json

    files = sorted(fla_tuning.SHIPPED_TUNING.glob("*/*.json"))
    assert files
    gpus = {path.parent.name for path in files}
    assert gpu_folder_name("NVIDIA H100 80GB HBM3") in gpus
    for path in files:
        data = json.loads(path.read_text())
        assert data["kernel_name"] == path.stem
        assert data["autotune_entries"], path
        for entry in data["autotune_entries"].values():
            assert isinstance(entry["autotune_key"], list)
            assert {"kwargs", "num_warps", "num_stages", "num_ctas"} <= entry["config"].keys()
