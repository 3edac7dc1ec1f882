"""Hub ids in ``model.path`` and ``data.tokenizer``: resolved through huggingface_hub's cache (a cache laid out here
as huggingface_hub lays it out, read offline), and one line naming the id and HF_HUB_OFFLINE when they cannot be.
No network is used: offline mode, or an endpoint that refuses connections."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants

from sft_trainer.config import PRESETS, SHIPPED_TOKENIZER, ConfigError, load_config
from sft_trainer.hub import is_hub_id

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def offline_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def _cached_repo(cache: Path, repo_id: str) -> Path:
    """The snapshot folder of ``repo_id`` at COMMIT, with refs/main pointing at it, as huggingface_hub writes them."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    return snapshot


def test_hub_ids_and_local_paths_are_told_apart(tmp_path):
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").mkdir()
    assert is_hub_id("Qwen/Qwen3.5-0.8B") and is_hub_id("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16")
    assert not is_hub_id(str(tmp_path / "org" / "name"))  # exists: local
    assert not is_hub_id("./org/name") and not is_hub_id("/abs/org") and not is_hub_id("a/b/c")
    assert not is_hub_id("../name") and not is_hub_id("org/..")
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        assert not is_hub_id("org/name")  # a relative folder that exists stays local
    finally:
        os.chdir(cwd)


def test_a_cached_hub_model_resolves_offline_to_its_snapshot(offline_cache):
    from cp_models import Qwen35ForCausalLM
    from sft_trainer.tokenizer_fit import load_tokenizer

    snapshot = _cached_repo(offline_cache, "tiny-org/tiny-qwen")
    tokenizer = load_tokenizer(str(SHIPPED_TOKENIZER))
    torch.manual_seed(0)
    model = Qwen35ForCausalLM(PRESETS["tiny-qwen3_5"](vocab_size=len(tokenizer)))
    model.save_pretrained(snapshot)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SHIPPED_TOKENIZER / name, snapshot / name)
    tokenizer_snapshot = _cached_repo(offline_cache, "tiny-org/tokenizer")
    shutil.copy(SHIPPED_TOKENIZER / "tokenizer.json", tokenizer_snapshot / "tokenizer.json")
    shutil.copy(SHIPPED_TOKENIZER / "tokenizer_config.json", tokenizer_snapshot / "tokenizer_config.json")

    cfg = load_config(None, ["--model.path", "tiny-org/tiny-qwen"])
    assert Path(cfg.model.path) == snapshot and Path(cfg.tokenizer_path) == snapshot
    cfg = load_config(None, ["--model.path", "tiny-org/tiny-qwen", "--data.tokenizer", "tiny-org/tokenizer"])
    assert Path(cfg.model.path) == snapshot and Path(cfg.data.tokenizer) == tokenizer_snapshot
    loaded = Qwen35ForCausalLM.from_pretrained(cfg.model.path)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("field", ["model.path", "data.tokenizer"])
def test_an_uncached_id_offline_is_one_line_naming_it_and_hf_hub_offline(offline_cache, field):
    with pytest.raises(ConfigError) as exc:
        load_config(None, [f"--{field}", "no-such-org/no-such-model"])
    assert len(exc.value.problems) == 1, exc.value.problems
    (problem,) = exc.value.problems
    assert problem.startswith(f"{field}='no-such-org/no-such-model' is not a local path, and as a Hugging Face Hub")
    assert "HF_HUB_OFFLINE=1" in problem and str(offline_cache) in problem and "\n" not in problem


def test_an_unreachable_hub_is_one_line_naming_the_id(tmp_path, monkeypatch):
    """Online mode against an endpoint that refuses connections (what a missing id or no network looks like)."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["--model.path", "no-such-org/no-such-model"])
    (problem,) = exc.value.problems
    assert problem.startswith("model.path='no-such-org/no-such-model' is not a local path, and as a Hugging Face")
    assert "HF_HUB_OFFLINE=1 to use the hub cache only" in problem and "\n" not in problem


def test_sft_train_stops_before_any_worker_on_an_uncached_id_offline(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    cmd = [sys.executable, "-c", "from sft_trainer.cli import main; main()", "--model.path", "no-org/no-model"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    problems = [line for line in proc.stderr.splitlines() if "no-org/no-model" in line]
    assert len(problems) == 1 and "HF_HUB_OFFLINE=1" in problems[0], proc.stderr
    assert "[sft-train] dp=" not in proc.stdout  # no worker started
