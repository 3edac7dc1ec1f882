"""cp_core.fla_tuning: which folder of fla kernel configs a process uses, and when it leaves fla alone (CPU)."""

import json
import os
import sys

import pytest
import torch

from cp_core import fla_tuning
from cp_core.fla_tuning import TUNING_DIR_ENV, fla_tuning_dir, gpu_folder_name, tuning_folder, use_fla_tuning

H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("FLA_CONFIG_DIR", "FLA_CACHE_MODE", TUNING_DIR_ENV):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def on_gpu(clean_env):
    """This process as if it ran on an H100 with fla 0.6.0 installed (not imported)."""
    clean_env.setattr(torch.cuda, "is_available", lambda: True)
    clean_env.setattr(torch.cuda, "get_device_name", lambda device=None: H100)
    clean_env.setattr(fla_tuning, "fla_version", lambda: "0.6.0")
    if "fla" in sys.modules:
        pytest.skip("fla is imported in this process")
    return clean_env


def test_gpu_folder_name_spells_the_device_as_fla_does():
    assert gpu_folder_name(H100) == "NVIDIA_H100_80GB_HBM3"
    assert gpu_folder_name("NVIDIA H200") == "NVIDIA_H200"
    assert gpu_folder_name(" --- ") == "unknown_gpu"


def test_the_users_folder_comes_first_per_gpu_and_fla_version(on_gpu, tmp_path):
    on_gpu.setenv(TUNING_DIR_ENV, str(tmp_path))
    expected = tmp_path / "NVIDIA_H100_80GB_HBM3" / "fla-0.6.0"
    assert tuning_folder(tmp_path) == expected
    assert fla_tuning_dir() == expected
    assert use_fla_tuning() == expected
    assert os.environ["FLA_CONFIG_DIR"] == str(expected)
    assert os.environ["FLA_CACHE_MODE"] == "strict"


def test_another_gpu_or_fla_version_gets_its_own_folder(on_gpu, tmp_path):
    on_gpu.setenv(TUNING_DIR_ENV, str(tmp_path))
    on_gpu.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert fla_tuning_dir() == tmp_path / "NVIDIA_A100_SXM4_80GB" / "fla-0.6.0"
    on_gpu.setattr(fla_tuning, "fla_version", lambda: "0.7.1")
    assert fla_tuning_dir() == tmp_path / "NVIDIA_A100_SXM4_80GB" / "fla-0.7.1"


def test_no_folder_without_a_gpu_or_without_fla(on_gpu, tmp_path):
    on_gpu.setenv(TUNING_DIR_ENV, str(tmp_path))
    on_gpu.setattr(fla_tuning, "fla_version", lambda: None)
    assert fla_tuning_dir() is None
    on_gpu.setattr(fla_tuning, "fla_version", lambda: "0.6.0")
    on_gpu.setattr(torch.cuda, "is_available", lambda: False)
    assert fla_tuning_dir() is None
    assert use_fla_tuning() is None
    assert "FLA_CONFIG_DIR" not in os.environ and "FLA_CACHE_MODE" not in os.environ


def test_the_shipped_folder_is_found_by_gpu_name_and_fla_version(on_gpu, tmp_path):
    (tmp_path / "NVIDIA_H100_80GB_HBM3" / "fla-0.6.0").mkdir(parents=True)
    on_gpu.setattr(fla_tuning, "SHIPPED_TUNING", tmp_path)
    assert fla_tuning_dir() == tmp_path / "NVIDIA_H100_80GB_HBM3" / "fla-0.6.0"
    on_gpu.setattr(fla_tuning, "fla_version", lambda: "0.7.1")  # configs tuned for another fla: not used
    assert fla_tuning_dir() is None
    on_gpu.setattr(fla_tuning, "fla_version", lambda: "0.6.0")
    on_gpu.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A10G")
    assert fla_tuning_dir() is None


@pytest.mark.parametrize("name,value", [("FLA_CACHE_MODE", "disabled"), ("FLA_CONFIG_DIR", "/elsewhere")])
def test_fla_settings_of_the_user_are_kept(on_gpu, tmp_path, name, value):
    on_gpu.setenv(TUNING_DIR_ENV, str(tmp_path))
    on_gpu.setenv(name, value)
    assert use_fla_tuning() is None
    assert os.environ[name] == value
    other = "FLA_CONFIG_DIR" if name == "FLA_CACHE_MODE" else "FLA_CACHE_MODE"
    assert other not in os.environ


def test_shipped_folders_hold_fla_config_files():
    """Every shipped file is one kernel's entries in fla's layout: a key hash -> the key and a full config, in a
    folder per GPU and fla version; the H100 folder is there."""
    files = sorted(fla_tuning.SHIPPED_TUNING.glob("*/fla-*/*.json"))
    assert files
    assert (fla_tuning.SHIPPED_TUNING / "NVIDIA_H100_80GB_HBM3" / "fla-0.6.0").is_dir()
    assert sorted(fla_tuning.SHIPPED_TUNING.rglob("*.json")) == files  # nothing outside that layout
    for path in files:
        data = json.loads(path.read_text())
        assert data["kernel_name"] == path.stem
        assert data["autotune_entries"], path
        for entry in data["autotune_entries"].values():
            assert isinstance(entry["autotune_key"], list)
            assert {"kwargs", "num_warps", "num_stages", "num_ctas"} <= entry["config"].keys()
