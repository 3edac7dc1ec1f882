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
from trainer_runs import _train_runs, _weights

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


BASE_STEPS = ("--parallel.cp", "1", "--train.steps", "2", "--train.grad_accum", "1")
FAMILIES = ["qwen3_5_moe", "nemotron_h", "qwen3_5_vl"]


@pytest.fixture(scope="module")
def export(tmp_path_factory, cp1_run, nemotron_runs, vl_runs) -> dict[str, tuple[Path, list[dict]]]:
    """family -> (the HF export of a tiny model trained for a few steps at cp = 1, that run's metrics). The dense
    family's, Nemotron-H's and the VL model's are the session's reference runs (conftest.py: 3 steps, trained once
    for this module and the others); the MoE model's trains here for 2 steps. Also "<family> again" -> (folder,
    metrics) of 2 steps from ``--model.path`` = that family's export. One launcher trains the MoE model, then the
    exports again, in turn."""
    built = {
        "qwen3_5": (cp1_run[0] / "hf", cp1_run[1]),
        "qwen3_5_moe": (tmp_path_factory.mktemp("qwen3_5_moe") / "hf", []),
        "nemotron_h": (nemotron_runs["cp1"][0] / "hf", nemotron_runs["cp1"][1]),
        "qwen3_5_vl": (vl_runs["cp1"][0] / "hf", vl_runs["cp1"][1]),
    }
    moe = (built["qwen3_5_moe"][0].parent, (*_moe_config_file(tmp_path_factory.mktemp("moe_config")), *BASE_STEPS))
    folder = tmp_path_factory.mktemp("again")
    again = [(folder / family, ("--model.path", str(built[family][0]), "--train.steps", "2")) for family in FAMILIES]
    moe_metrics, *again_metrics = _train_runs(moe, *again)
    built["qwen3_5_moe"] = (built["qwen3_5_moe"][0], moe_metrics)
    for (out, _), family, metrics in zip(again, FAMILIES, again_metrics, strict=True):
        built[f"{family} again"] = (out, metrics)
    return built


@pytest.mark.parametrize("family", FAMILIES)
def test_an_export_trains_again_from_model_path(family, export):
    """The dense family's round trip is the LoRA test below (its runs start from the dense export)."""
    hf, base = export[family]
    config_text = (hf / "config.json").read_text()
    if family == "nemotron_h" and Version(transformers.__version__) >= Version("5.24"):
        assert '"__float__": "Infinity"' in config_text  # the time_step_limit that json + from_dict rejected
    out, metrics = export[f"{family} again"]
    losses = [m["loss"] for m in metrics]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    # The first row is the base run's first row (same data, seed and tokenizer), seen twice in training: lower loss.
    assert losses[0] < base[0]["loss"], (base, losses)
    assert load_tokenizer(out / "hf").get_vocab() == load_tokenizer(hf).get_vocab()  # the checkpoint's own
    plan = plan_main(["--model.path", str(hf), "--json"])
    assert plan["fits"] and not plan["problems"]


def _lora(out: Path, model: Path, cp: int, *extra: str) -> tuple[Path, tuple[str, ...]]:
    lora = ("--train.lora.enabled", "--train.lora.rank", "4", "--train.lr", "1e-2", "--parallel.attention_cp", "auto")
    return out, ("--model.path", str(model), "--parallel.cp", str(cp), *lora, *extra)


# cp 2 and 4 sum each token's loss and gradients in another order than cp 1 (fp32 rounding, ~1e-7 relative), and
# Adam's normalized updates carry that rounding into the adapters. Measured over 3 steps: losses within 1.4e-7
# relative of cp 1 (cp 4's first step: 7e-8); the bound leaves 15x room.
LORA_CP_RTOL = 2e-6
# The weights the default train.lora.targets adapt (every other tensor of the merged export equals the base's).
LORA_TARGETS = tuple(f"{name}.weight" for name in ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "out_proj"))


def test_lora_from_a_checkpoint_is_seeded_at_any_cp(export, tmp_path):
    hf, _ = export["qwen3_5"]
    dropout = ("--train.lora.dropout", "0.1")  # the same config twice, LoRA dropout on (the runs "again1", "again2")
    runs = {f"cp{cp}": _lora(tmp_path / f"cp{cp}", hf, cp) for cp in (1, 2, 4)}
    runs |= {name: _lora(tmp_path / name, hf, 2, *dropout) for name in ("again1", "again2")}
    trained = dict(zip(runs, _train_runs(*runs.values()), strict=True))  # one launcher trains them in turn
    losses = {cp: [m["loss"] for m in trained[f"cp{cp}"]] for cp in (1, 2, 4)}
    print(f"\n[lora from checkpoint] losses per cp: {json.dumps(losses)}")
    base, tuned = _weights(hf.parent), _weights(tmp_path / "cp1")  # the merged export: adapted layers moved only
    moved = {n for n in base if not torch.equal(base[n], tuned[n])}
    assert moved and all(n.endswith(LORA_TARGETS) for n in moved), sorted(moved)
    for cp in (2, 4):
        for a, b in zip(losses[1], losses[cp], strict=True):
            assert abs(a - b) <= LORA_CP_RTOL * abs(a), (cp, losses)
    plan = plan_main(["--model.path", str(hf), "--json"])
    assert plan["fits"] and not plan["problems"]

    # Dropout on: bit-identical losses (adapters, dropout masks and data order seeded).
    first, second = ([m["loss"] for m in trained[name]] for name in ("again1", "again2"))
    assert first == second and first != losses[2], (first, second, losses[2])
