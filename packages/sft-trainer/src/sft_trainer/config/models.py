"""Model rules: which model families, layer types, CP styles and LoRA targets the trainer supports, and the
transformers config a ``[model]`` section names."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from cp_models.families import FAMILIES
from sft_trainer.config.errors import ConfigError
from sft_trainer.config.presets import PRESETS, SHIPPED_MODEL_CONFIGS
from sft_trainer.job_failure import one_line

if TYPE_CHECKING:
    from sft_trainer.config.schema import TrainConfig
    from sft_trainer.config.sections import ModelConfig


# Per model family (cp_models.families): the CP styles each layer type runs under (``parallel.cp_style``; "auto"
# picks the family's first style), and the nn.Linear names LoRA may target (not lm_head: the tiled loss reads its
# weight directly, and it is often tied to the embeddings).
LAYER_CP_STYLES: dict[str, dict[str, tuple[str, ...]]] = {
    name: dict(family.layer_cp_styles) for name, family in FAMILIES.items()
}
FAMILY_CP_STYLES = {name: family.cp_styles for name, family in FAMILIES.items()}
LINEAR_NAMES: dict[str, tuple[str, ...]] = {name: family.lora_targets for name, family in FAMILIES.items()}
NEMOTRON_H_MODEL_TYPES = FAMILIES["nemotron_h"].model_types
_VL_MODEL_TYPES = FAMILIES["qwen3_5"].vl_model_types
_PATTERN_LAYERS = {"M": "Mamba-2", "*": "attention", "-": "MLP", "E": "MoE"}  # Nemotron-H's hybrid_override_pattern


def is_vision_language(hf_config) -> bool:
    """Whether a transformers config is a Qwen3.5-VL one (a vision tower beside the text model)."""
    return hf_config.model_type in _VL_MODEL_TYPES and getattr(hf_config, "vision_config", None) is not None


def model_family(hf_config) -> str:
    """``"nemotron_h"`` or ``"qwen3_5"`` (text, MoE or VL) for a transformers config."""
    return "nemotron_h" if hf_config.model_type in NEMOTRON_H_MODEL_TYPES else "qwen3_5"


def _model_source(model: ModelConfig) -> str:
    if model.path is not None:
        return f"model.path={model.path!r}"
    if model.config is not None:
        return f"model.config={model.config!r}"
    return f"model.preset={model.preset!r}"


def resolve_model_config(model: ModelConfig, vocab_size: int | None = None, token_ids: Mapping[str, int] | None = None):
    """The transformers config ``model`` names: the checkpoint's, the config file's, or the preset's.

    A VL (``qwen3_5``) config is returned whole; use ``cp_models.load_text_config`` for its text part.
    ``vocab_size`` sets the preset's vocabulary and ``token_ids`` the VL preset's placeholder ids (checkpoints and
    config files keep their own).
    Raises :class:`ConfigError` naming the field when the file is missing, unreadable or of an unsupported
    model type.
    """
    from cp_models.qwen3_5 import SUPPORTED_MODEL_TYPES as QWEN35_MODEL_TYPES

    supported_types = (*QWEN35_MODEL_TYPES, *NEMOTRON_H_MODEL_TYPES)
    source = _model_source(model)
    if model.path is not None and model.config is not None:
        raise ConfigError(
            f"model.path={model.path!r} and model.config={model.config!r}: set one (a checkpoint to fine-tune, "
            "or a config.json for a randomly initialized model), not both"
        )
    if model.path is None and model.config is None:
        if model.preset is None:
            raise ConfigError("model: set one of model.path, model.config or model.preset")
        kwargs = {} if vocab_size is None else {"vocab_size": vocab_size}
        if model.preset.endswith("-vl") and token_ids:
            kwargs.update(token_ids)
        return PRESETS[model.preset](**kwargs)

    given = Path(model.path if model.path is not None else model.config)
    if model.path is None and not given.exists() and (SHIPPED_MODEL_CONFIGS / f"{model.config}.json").is_file():
        given = SHIPPED_MODEL_CONFIGS / f"{model.config}.json"  # a shipped shape, by name
    file = given / "config.json" if given.is_dir() else given
    if model.path is not None and not given.is_dir():
        what = "not a folder" if given.exists() else "no such folder"
        raise ConfigError(f"{source}: {what}; model.path is an HF checkpoint folder with a config.json")
    if not file.is_file():
        shapes = ", ".join(sorted(f.stem for f in SHIPPED_MODEL_CONFIGS.glob("*.json")))
        hint = f" (shipped model.config shapes: {shapes})" if model.path is None else ""
        raise ConfigError(f"{source}: {file} does not exist{hint}")
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{source}: cannot read {file} as JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {file} is not a JSON object")
    model_type = raw.get("model_type")
    if model_type not in supported_types:
        raise ConfigError(
            f"{source}: model_type={model_type!r} is not supported; supported model types: "
            f"{', '.join(sorted(supported_types))}"
        )
    from cp_models.config_rules import size_problem

    # transformers builds a list per layer while it reads the file: a layer count of 10**9 would not return
    for section in (raw, raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}):
        if problem := size_problem("num_hidden_layers", section.get("num_hidden_layers")):
            raise ConfigError(f"{source}: {problem}")
    pattern = raw.get("hybrid_override_pattern")
    if model_type in NEMOTRON_H_MODEL_TYPES and isinstance(pattern, str) and set(pattern) - set(_PATTERN_LAYERS):
        unknown = ", ".join(map(repr, sorted(set(pattern) - set(_PATTERN_LAYERS))))
        layers = ", ".join(f"{c} ({name})" for c, name in _PATTERN_LAYERS.items())
        raise ConfigError(f"{source}: hybrid_override_pattern={pattern!r}: {unknown} is not a layer; use {layers}")
    from transformers import AutoConfig

    # Read by transformers itself, as from_pretrained will: it decodes what it writes (e.g. an infinite
    # time_step_limit as {"__float__": "Infinity"}). Never remote code: the model type is one of ours.
    try:
        return AutoConfig.from_pretrained(str(file), trust_remote_code=False)
    except Exception as exc:  # transformers' own validation of the config's values
        raise ConfigError(f"{source}: transformers rejects {file}: {one_line(exc)}") from exc


def _training_term_problems(text, source: str) -> list[str]:
    """What transformers' training of this config adds that cp_models' does not (attention dropout, the routers'
    load-balancing loss), one line each with the config edit that leaves it out: never a silently other objective."""
    problems = []
    dropout = getattr(text, "attention_dropout", 0.0) or 0.0
    if dropout > 0:
        problems.append(
            f"{source}: attention_dropout={dropout}: cp_models' attention has no dropout; set "
            '"attention_dropout": 0.0 in its config.json to train without it'
        )
    coefficient = getattr(text, "router_aux_loss_coef", 0.0) or 0.0
    if getattr(text, "output_router_logits", False) and coefficient > 0:
        problems.append(
            f"{source}: output_router_logits=true adds transformers' router load-balancing loss "
            f"(router_aux_loss_coef={coefficient}) to the loss, which sft-train does not; set "
            '"output_router_logits": false in its config.json to train without it'
        )
    return problems


def _check_model(cfg: TrainConfig) -> list[str]:
    from cp_core import ContextParallelError, resolve_attention_cp_style

    try:
        hf = resolve_model_config(cfg.model)
    except ConfigError as exc:
        return exc.problems
    source = _model_source(cfg.model)
    par, problems = cfg.parallel, []
    family = model_family(hf)
    style = par.resolve_cp_style(family)

    is_vl = is_vision_language(hf)
    if is_vl and style != "ulysses":
        problems.append(
            f"parallel.cp_style={par.cp_style!r}: {source} is a vision-language config (model_type "
            f"{hf.model_type!r}, has vision_config), which requires cp_style='ulysses'"
        )
    if family == "nemotron_h":
        text = hf
        layer_types = list(text.layers_block_type)
        conv_width, conv_name = text.conv_kernel, "Mamba conv_kernel"
    else:
        from cp_models import load_text_config

        text = load_text_config(hf)
        layer_types = list(text.layer_types[: text.num_hidden_layers])
        conv_width, conv_name = text.linear_conv_kernel_dim, "GDN conv halo needs linear_conv_kernel_dim"

    from cp_models.config_rules import config_problems

    sizes = config_problems(text, FAMILIES[family].size_fields)
    if sizes:  # the checks below divide by these sizes
        return [*problems, *(f"{source}: {problem}" for problem in sizes)]

    layers: dict[str, list[int]] = {}
    for i, layer_type in enumerate(layer_types):
        layers.setdefault(layer_type, []).append(i)
    supported = LAYER_CP_STYLES[family]
    unstyled = []
    for layer_type, idx in layers.items():
        styles = supported.get(layer_type)
        if styles is None:
            problems.append(
                f"{source}: layer type {layer_type!r} (layers {idx}) is not supported; supported layer types: "
                f"{', '.join(supported)}"
            )
        elif style not in styles:
            unstyled.append(f"{layer_type!r} (layers {idx}; runs under cp_style {' or '.join(map(repr, styles))})")
    if unstyled:
        problems.append(
            f"parallel.cp_style={par.cp_style!r} does not support the layer types of {source} "
            f"({hf.model_type}): {', '.join(unstyled)}"
        )

    if "full_attention" in layers:
        q, kv = text.num_attention_heads, text.num_key_value_heads
        try:
            resolve_attention_cp_style(par.attention_cp, q, kv, par.cp)
        except ContextParallelError as exc:
            problems.append(
                f"parallel.cp={par.cp} with parallel.attention_cp={par.attention_cp!r} vs the attention heads of "
                f"{source} (num_attention_heads={q}, num_key_value_heads={kv}): {exc}"
            )
    if family == "qwen3_5" and "linear_attention" in layers:
        from cp_models.qwen3_5 import check_gdn_activation

        try:
            check_gdn_activation(text.hidden_act)
        except ContextParallelError as exc:
            problems.append(f"{source}: {exc}")
    problems += _training_term_problems(text, source)
    if family == "nemotron_h" and "linear_attention" in layers and style == "a2a":
        from cp_core.head_parallel import check_head_parallel

        heads, groups = text.mamba_num_heads, text.n_groups
        try:
            check_head_parallel(heads, groups, par.cp, what="Mamba-2 head-parallel (a2a) CP")
        except ContextParallelError as exc:
            problems.append(
                f"parallel.cp={par.cp} with parallel.cp_style='a2a' vs the Mamba heads of {source} "
                f"(mamba_num_heads={heads}, n_groups={groups}): {exc}; or use cp_style='state_passing' (any cp)"
            )
    if "linear_attention" in layers and not (family == "nemotron_h" and style == "a2a"):
        halo = conv_width - 1
        if par.cp > 1 and cfg.data.seq_len // par.cp < halo:
            problems.append(
                f"data.seq_len={cfg.data.seq_len} is too short for parallel.cp={par.cp}: each CP shard holds "
                f"seq_len/cp={cfg.data.seq_len // par.cp} tokens but the {conv_name}-1={halo} "
                f"(seq_len >= cp * {halo} = {par.cp * halo})"
            )

    lora = cfg.train.lora
    if lora.enabled:
        names = LINEAR_NAMES[family]
        unknown = [t for t in lora.targets if t not in names]
        if unknown:
            problems.append(
                f"train.lora.targets={lora.targets!r}: {unknown} are not linear layers of {source}; choose from "
                f"{', '.join(names)}"
            )
    return problems
