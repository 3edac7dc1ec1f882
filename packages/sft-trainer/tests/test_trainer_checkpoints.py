"""Runs that start from a checkpoint. For every family (Qwen3.5 dense, MoE, VL, Nemotron-H): a tiny model trains,
exports, and the export trains again from ``--model.path`` with its own tokenizer (the default), and
``sft-train plan`` reads it. LoRA from a checkpoint is seeded by ``train.seed``: cp 1, 2 and 4 give the same losses
and two runs of one config give bit-identical ones."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version
from trainer_runs import _train, _weights

from sft_trainer.cli import plan_main
from sft_trainer.config import tiny_qwen35_config
from sft_trainer.tokenizer_fit import load_tokenizer


def _moe_config_file(folder: Path) -> list[str]:
    from transformers import Qwen3_5MoeTextConfig

    base = tiny_qwen35_config(vocab_size=1024).to_dict()
    base.pop("intermediate_size", None)
    base.pop("model_type", None)
    base.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40)
    Qwen3_5MoeTextConfig(**base).save_pretrained(folder)
    return ["--model.config", str(folder / "config.json")]


SOURCES = {
    "qwen3_5": lambda folder: ["--model.preset", "tiny-qwen3_5"],
    "qwen3_5_moe": _moe_config_file,
    "nemotron_h": lambda folder: ["--model.preset", "tiny-nemotron_h"],
    "qwen3_5_vl": lambda folder: ["--config", "tiny_vl_cpu"],
}
BASE_STEPS = ("--parallel.cp", "1", "--train.steps", "2", "--train.grad_accum", "1")


@pytest.fixture(scope="module")
def export(tmp_path_factory, cp1_run):
    """family -> (the HF export of a tiny model trained for 2 steps, that run's metrics); built once per family.
    The dense family's is the session's reference run (conftest.py: 3 steps), trained once for both modules."""
    built: dict[str, tuple[Path, list[dict]]] = {"qwen3_5": (cp1_run[0] / "hf", cp1_run[1])}

    def get(family: str) -> tuple[Path, list[dict]]:
        if family not in built:
            out = tmp_path_factory.mktemp(family)
            source = SOURCES[family](tmp_path_factory.mktemp(f"{family}_config"))
            built[family] = out / "hf", _train(out, *source, *BASE_STEPS)
        return built[family]

    return get


@pytest.mark.parametrize("family", ["qwen3_5_moe", "nemotron_h", "qwen3_5_vl"])
def test_an_export_trains_again_from_model_path(family, export, tmp_path):
    """The dense family's round trip is the LoRA test below (its runs start from the dense export)."""
    hf, base = export(family)
    config_text = (hf / "config.json").read_text()
    if family == "nemotron_h" and Version(transformers.__version__) >= Version("5.24"):
        assert '"__float__": "Infinity"' in config_text  # the time_step_limit that json + from_dict rejected
    metrics = _train(tmp_path, "--model.path", str(hf), "--train.steps", "2")
    losses = [m["loss"] for m in metrics]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    # The first row is the base run's first row (same data, seed and tokenizer), seen twice in training: lower loss.
    assert losses[0] < base[0]["loss"], (base, losses)
    assert load_tokenizer(tmp_path / "hf").get_vocab() == load_tokenizer(hf).get_vocab()  # the checkpoint's own
    plan = plan_main(["--model.path", str(hf), "--json"])
    assert plan["fits"] and not plan["problems"]


def _lora(out: Path, model: Path, cp: int, *extra: str) -> list[float]:
    lora = ("--train.lora.enabled", "--train.lora.rank", "4", "--train.lr", "1e-2", "--parallel.attention_cp", "auto")
    metrics = _train(out, "--model.path", str(model), "--parallel.cp", str(cp), *lora, *extra)
    return [m["loss"] for m in metrics]


# cp 2 and 4 sum each token's loss and gradients in another order than cp 1 (fp32 rounding, ~1e-7 relative), and
# Adam's normalized updates carry that rounding into the adapters. Measured over 3 steps: losses within 1.4e-7
# relative of cp 1 (cp 4's first step: 7e-8); the bound leaves 15x room.
LORA_CP_RTOL = 2e-6
# The weights the default train.lora.targets adapt (every other tensor of the merged export equals the base's).
LORA_TARGETS = tuple(f"{name}.weight" for name in ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "out_proj"))


def test_lora_from_a_checkpoint_is_seeded_at_any_cp(export, tmp_path):
    hf, _ = export("qwen3_5")
    losses = {cp: _lora(tmp_path / f"cp{cp}", hf, cp) for cp in (1, 2, 4)}
    print(f"\n[lora from checkpoint] losses per cp: {json.dumps(losses)}")
    base, tuned = _weights(hf.parent), _weights(tmp_path / "cp1")  # the merged export: adapted layers moved only
    moved = {n for n in base if not torch.equal(base[n], tuned[n])}
    assert moved and all(n.endswith(LORA_TARGETS) for n in moved), sorted(moved)
    for cp in (2, 4):
        for a, b in zip(losses[1], losses[cp], strict=True):
            assert abs(a - b) <= LORA_CP_RTOL * abs(a), (cp, losses)
    plan = plan_main(["--model.path", str(hf), "--json"])
    assert plan["fits"] and not plan["problems"]

    # The same config twice, LoRA dropout on: bit-identical losses (adapters, dropout masks and data order seeded).
    dropout = ("--train.lora.dropout", "0.1")
    first = _lora(tmp_path / "again1", hf, 2, *dropout)
    second = _lora(tmp_path / "again2", hf, 2, *dropout)
    assert first == second and first != losses[2], (first, second, losses[2])
