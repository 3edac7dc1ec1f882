"""The model-family specs: lookup by HF model type, and that each spec's names match the models they describe
(the LoRA targets are the models' linear layers, the layer types are the ones its configs produce, the presets
build the family's model)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

from cp_core import ContextParallelError
from cp_models.families import FAMILIES, NEMOTRON_H, PRESETS, QWEN35, SUPPORTED_MODEL_TYPES, family_for
from cp_models.presets import tiny_qwen35_moe_config


def _linear_names(model: nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}


@pytest.mark.parametrize(
    ("model_type", "family"),
    [
        ("qwen3_5_text", QWEN35),
        ("qwen3_5_moe_text", QWEN35),
        ("qwen3_5", QWEN35),
        ("qwen3_5_moe", QWEN35),
        ("nemotron_h", NEMOTRON_H),
    ],
)
def test_family_for_finds_every_supported_model_type(model_type, family):
    assert family_for(model_type) is family
    assert model_type in SUPPORTED_MODEL_TYPES


def test_family_for_names_the_supported_types():
    with pytest.raises(ContextParallelError, match=r"model_type='llama' is not supported; supported model types: "):
        family_for("llama")


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_build_their_family_model(preset):
    if preset.endswith("-vl"):  # the VL model lives in cp_vlm, which depends on cp_models (not installed beside it)
        pytest.importorskip("cp_vlm")
    config = PRESETS[preset](vocab_size=96)
    family = family_for(config)
    assert preset in family.tiny_presets
    assert config.model_type in family.model_types
    torch.manual_seed(0)
    model = family.model_class_for(config)(config)
    assert family.is_vision_language(config) == preset.endswith("-vl")
    assert type(model).__name__ == (
        "Qwen35VLForConditionalGeneration" if preset.endswith("-vl") else family.model_class.__name__
    )
    text = family.load_text_config(config)
    layer_types = set(getattr(text, family.layer_types_attribute)[: len(model.decoder_layers())])
    assert layer_types <= set(family.layer_cp_styles)
    assert {hf_type for hf_type, _ in family.layer_parts.values()} >= layer_types


@pytest.mark.parametrize(
    ("family", "config"),
    [
        (QWEN35, lambda: PRESETS["tiny-qwen3_5"](96)),
        (QWEN35, lambda: tiny_qwen35_moe_config(96)),
        (NEMOTRON_H, lambda: PRESETS["tiny-nemotron_h"](96)),
    ],
    ids=["qwen3_5", "qwen3_5_moe", "nemotron_h"],
)
def test_lora_targets_are_the_models_linear_layers(family, config):
    """Every nn.Linear of the model but the LM head is a target, and every target is a linear layer of it (the
    dense and MoE Qwen3.5 together hold all of Qwen3.5's)."""
    names = _linear_names(family.model_class(config())) - {"lm_head"}
    assert names <= set(family.lora_targets)
    if family is NEMOTRON_H:
        assert names == set(family.lora_targets)


def test_qwen35_lora_targets_are_covered_by_dense_and_moe():
    names = _linear_names(QWEN35.model_class(PRESETS["tiny-qwen3_5"](96)))
    names |= _linear_names(QWEN35.model_class(tiny_qwen35_moe_config(96)))
    assert names - {"lm_head"} == set(QWEN35.lora_targets)


def test_cp_styles_and_coefficient_keys():
    assert QWEN35.resolve_cp_style("auto") == "ulysses"
    assert NEMOTRON_H.resolve_cp_style("auto") == "state_passing"
    assert NEMOTRON_H.resolve_cp_style("a2a") == "a2a"
    with pytest.raises(ContextParallelError, match="'a2a' is not a qwen3_5 style"):
        QWEN35.resolve_cp_style("a2a")
    for family in FAMILIES.values():
        parts = {key.split(".", 1)[1] for key in family.coefficient_keys}
        assert all(key.startswith(f"{family.name}.") for key in family.coefficient_keys)
        assert set(family.layer_parts) | {"block", "model"} <= parts


def _family_configs(family):
    """Tiny configs of ``family`` that together set every size it names (dense and MoE)."""
    from cp_models.presets import tiny_nemotron_h_config, tiny_qwen35_config

    if family is QWEN35:
        return [tiny_qwen35_config(vocab_size=64), tiny_qwen35_moe_config(vocab_size=64)]
    return [tiny_nemotron_h_config(vocab_size=64)]


@pytest.mark.parametrize("family", [QWEN35, NEMOTRON_H], ids=lambda f: f.name)
def test_every_size_field_is_checked_when_the_model_is_built(family):
    """Each size the family names is set by its tiny configs (no typo in the list), and 0, a negative or a
    float there stops the build with one line naming the field."""
    configs = _family_configs(family)
    assert set(family.size_fields) <= {f for c in configs for f in family.size_fields if getattr(c, f, None)}
    for name in family.size_fields:
        config = next(c for c in configs if getattr(c, name, None))
        for bad in (0, -2, 2.5):
            broken = type(config).from_dict(config.to_dict())
            object.__setattr__(broken, name, bad)  # past transformers' own type check, where it has one
            with pytest.raises(ContextParallelError, match=f"{name}={bad!r}: must be a positive integer"):
                family.model_class(broken)


def test_head_and_expert_counts_must_agree():
    config = tiny_qwen35_moe_config(vocab_size=64)
    config.num_key_value_heads = config.num_attention_heads - 1
    config.num_experts_per_tok = config.num_experts + 1
    with pytest.raises(ContextParallelError) as info:
        QWEN35.model_class(config)
    heads, experts = config.num_attention_heads, config.num_experts
    assert str(info.value) == (
        f"qwen3_5_moe_text config: num_attention_heads={heads} must be a multiple of num_key_value_heads={heads - 1}; "
        f"num_experts_per_tok={experts + 1} must be at most num_experts={experts}"
    )


@pytest.mark.parametrize(
    ("family", "changes", "message"),
    [
        (QWEN35, {"hidden_size": 2**30}, "hidden_size=1073741824: must be at most 16777216"),
        (QWEN35, {"num_hidden_layers": 10**6}, "num_hidden_layers=1000000: must be at most 10000"),
        (QWEN35, {"rms_norm_eps": -1.0}, "rms_norm_eps=-1.0: must be a finite number >= 0"),
        (QWEN35, {"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, "rope_theta=0: must be a finite"),
        (
            QWEN35,
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 2.0}},
            "partial_rotary_factor=2.0: must be in (0, 1]",
        ),
        (
            QWEN35,
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.2}},
            "partial_rotary_factor=0.2 of head_dim=16 rotates 3 dims: must be an even number",
        ),
        (NEMOTRON_H, {"layers_block_type": []}, "layers_block_type=[]: the model has no layers"),
        (NEMOTRON_H, {"n_groups": 3}, "mamba_num_heads=8 must be a multiple of n_groups=3"),
        (NEMOTRON_H, {"layer_norm_epsilon": float("nan")}, "layer_norm_epsilon=nan: must be a finite number >= 0"),
        (NEMOTRON_H, {"topk_group": 2}, "topk_group=2 must be at most n_group=1"),
        (
            NEMOTRON_H,
            {"n_routed_experts": 4, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2},
            "n_routed_experts=4 in n_group=4 groups is 1 expert a group",
        ),
        (
            NEMOTRON_H,
            {"n_routed_experts": 8, "n_group": 4, "topk_group": 1, "num_experts_per_tok": 3},
            "num_experts_per_tok=3 must be at most topk_group=1 x 2 experts a group",
        ),
    ],
    ids=lambda v: v.name if hasattr(v, "name") else None,
)
def test_config_constants_out_of_range_stop_the_build(family, changes, message):
    from cp_models.config_rules import config_problems

    config = _family_configs(family)[0]
    broken = type(config).from_dict(config.to_dict())
    for name, value in changes.items():
        object.__setattr__(broken, name, value)
    problems = config_problems(broken, family.size_fields)
    assert any(message in p for p in problems), problems
    with pytest.raises(ContextParallelError, match=re.escape(message)):
        family.model_class(broken)
