"""One spec per model family: everything a trainer needs to know about a family, in one place.

A :class:`ModelFamily` names the model class, the HF ``model_type`` values it loads (text and vision-language),
the layers LoRA may target, the CP styles and which layer types run under each, the tiny preset, and the keys of
the memory planner's coefficient table. :func:`family_for` finds the family of a transformers config. Adding a
family means one modeling file and one entry here (see docs/architecture.md, "Adding a model family").
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch.nn as nn

from cp_core import ContextParallelError
from cp_models import nemotron_h, qwen3_5
from cp_models.nemotron_h import NemotronHForCausalLM, load_nemotron_h_config
from cp_models.presets import tiny_nemotron_h_config, tiny_qwen35_config, tiny_qwen35_vl_config
from cp_models.qwen3_5 import TEXT_MODEL_TYPES, VL_MODEL_TYPES, Qwen35ForCausalLM, load_text_config


def _frozen(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class ModelFamily:
    name: str
    """The family's key: ``parallel.cp_style`` rules, the planner's coefficient names (``"<name>.<part>"``)."""
    model_class: type[nn.Module]
    """The causal LM (``from_pretrained``, ``save_pretrained``, ``forward(input_ids, seq_lens, ...)``)."""
    load_text_config: Callable[[Any], Any]
    """A checkpoint folder or transformers config -> the text config ``model_class`` is built from."""
    text_model_types: tuple[str, ...]
    """HF ``model_type`` values of the family's text configs."""
    vl_model_types: tuple[str, ...] = ()
    """HF ``model_type`` values of its vision-language checkpoints (a config with a ``vision_config``)."""
    vl_model_class: str | None = None
    """``"module:Class"`` of the vision-language model (cp_vlm builds on cp_models, so it is imported on use)."""
    lora_targets: tuple[str, ...] = ()
    """The ``nn.Linear`` names LoRA may target (not ``lm_head``: the tiled loss reads its weight directly)."""
    cp_styles: tuple[str, ...] = ()
    """``parallel.cp_style`` values; the first is what ``"auto"`` picks."""
    cp_style_argument: str | None = None
    """The ``model_class`` keyword the CP style goes to (None: the family has one style)."""
    layer_cp_styles: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """HF layer type -> the CP styles it runs under."""
    layer_types_attribute: str = "layer_types"
    """The text config's attribute listing each layer's HF layer type."""
    size_fields: tuple[str, ...] = ()
    """The text config's sizes, each a positive integer where set (``cp_models.config_rules``)."""
    tiny_presets: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    """``model.preset`` name -> the tiny config it builds (``vocab_size`` first)."""
    layer_parts: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    """The planner's layer part -> (HF layer type, what it is)."""
    coefficient_keys: tuple[str, ...] = ()
    """The planner's activation coefficient entries for this family (``"<name>.<part>"``)."""

    @property
    def model_types(self) -> tuple[str, ...]:
        return (*self.text_model_types, *self.vl_model_types)

    def is_vision_language(self, hf_config) -> bool:
        """Whether ``hf_config`` is one of this family's vision-language configs (a vision tower beside the text)."""
        return hf_config.model_type in self.vl_model_types and getattr(hf_config, "vision_config", None) is not None

    def model_class_for(self, hf_config) -> type[nn.Module]:
        """The model class that loads ``hf_config``: the vision-language one for a VL config, else ``model_class``."""
        if not self.is_vision_language(hf_config):
            return self.model_class
        module, name = self.vl_model_class.split(":")
        return getattr(importlib.import_module(module), name)

    def resolve_cp_style(self, style: str) -> str:
        """``style``, with ``"auto"`` resolved to the family's first style; raises for a style it has not."""
        resolved = self.cp_styles[0] if style == "auto" else style
        if resolved not in self.cp_styles:
            raise ContextParallelError(f"cp_style={style!r} is not a {self.name} style; choose from {self.cp_styles}")
        return resolved


QWEN35 = ModelFamily(
    name="qwen3_5",
    model_class=Qwen35ForCausalLM,
    load_text_config=load_text_config,
    text_model_types=TEXT_MODEL_TYPES,
    vl_model_types=VL_MODEL_TYPES,
    vl_model_class="cp_vlm.qwen3_5_vl:Qwen35VLForConditionalGeneration",
    lora_targets=(
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "in_proj_qkv",
        "in_proj_z",
        "in_proj_b",
        "in_proj_a",
        "out_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "shared_expert_gate",
    ),
    # "ulysses": softmax attention by the attention CP style (Ulysses, gathered or ring-passed KV), GDN by the
    # conv halo and state passing.
    cp_styles=("ulysses",),
    layer_cp_styles=_frozen({"full_attention": ("ulysses",), "linear_attention": ("ulysses",)}),
    size_fields=qwen3_5.SIZE_FIELDS,
    tiny_presets=_frozen({"tiny-qwen3_5": tiny_qwen35_config, "tiny-qwen3_5-vl": tiny_qwen35_vl_config}),
    layer_parts=_frozen(
        {
            "gdn": ("linear_attention", "Gated DeltaNet"),
            "attention": ("full_attention", "gated softmax attention"),
            "mlp": ("mlp", "SwiGLU MLP"),
            "moe": ("moe", "sparse MoE"),
        }
    ),
    coefficient_keys=tuple(
        f"qwen3_5.{part}" for part in ("block", "gdn", "gdn_prepass", "attention", "mlp", "moe", "model")
    ),
)

_NEMOTRON_H_STYLES = ("state_passing", "a2a")
NEMOTRON_H = ModelFamily(
    name="nemotron_h",
    model_class=NemotronHForCausalLM,
    load_text_config=load_nemotron_h_config,
    text_model_types=("nemotron_h",),
    lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj", "up_proj", "down_proj"),
    # The style is the Mamba-2 strategy ("state_passing": conv halo + SSD state passing; "a2a": head-parallel
    # all-to-all); attention follows the attention CP style, MLP and MoE need no CP.
    cp_styles=_NEMOTRON_H_STYLES,
    cp_style_argument="mamba_cp_style",
    layer_cp_styles=_frozen(dict.fromkeys(("linear_attention", "full_attention", "mlp", "moe"), _NEMOTRON_H_STYLES)),
    layer_types_attribute="layers_block_type",
    size_fields=nemotron_h.SIZE_FIELDS,
    tiny_presets=_frozen({"tiny-nemotron_h": tiny_nemotron_h_config}),
    layer_parts=_frozen(
        {
            "mamba": ("linear_attention", "Mamba-2"),
            "attention": ("full_attention", "attention"),
            "mlp": ("mlp", "squared-ReLU MLP"),
            "moe": ("moe", "MoE"),
        }
    ),
    coefficient_keys=tuple(
        f"nemotron_h.{part}" for part in ("block", "mamba", "mamba_correction", "attention", "mlp", "moe", "model")
    ),
)

FAMILIES: Mapping[str, ModelFamily] = _frozen({family.name: family for family in (QWEN35, NEMOTRON_H)})
"""Every family, by name."""

PRESETS: Mapping[str, Callable[..., Any]] = _frozen(
    {name: preset for family in FAMILIES.values() for name, preset in family.tiny_presets.items()}
)
"""Every tiny preset, by ``model.preset`` name."""

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(t for family in FAMILIES.values() for t in family.model_types)


def family_for(config_or_model_type) -> ModelFamily:
    """The family of a transformers config (or of an HF ``model_type`` string); raises
    :class:`ContextParallelError` naming the supported model types."""
    model_type = getattr(config_or_model_type, "model_type", config_or_model_type)
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family
    raise ContextParallelError(
        f"model_type={model_type!r} is not supported; supported model types: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
    )
