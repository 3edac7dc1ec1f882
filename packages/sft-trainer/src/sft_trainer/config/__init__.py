"""The trainer's configuration: pydantic models read from TOML, overridden from the command line, checked at load.

A run is described by one TOML file with torchtitan-like sections (``[model]``, ``[data]``, ``[parallel]``,
``[train]``, ``[train.lora]``, ``[checkpoint]``, ``[logging]``, ``[logging.wandb]``) and a top-level
``output_dir``. Command-line overrides address any key by its dotted path::

    sft-train --config run.toml --model.path /ckpt/Qwen3.5-0.8B --parallel.cp 2 --train.steps=10

:func:`load_config` validates everything before any process group or weight exists: types, enums, ranges and
unknown keys (pydantic), the rules that tie fields together (``seq_len`` divisible by ``cp``, one row per micro
batch under CP, warmup within the run, ...) and the rules that depend on the model's ``config.json`` (attention
heads vs ``cp`` for Ulysses, layer types vs the CP style, the GDN conv halo vs the shard length). Every problem
is reported as ``field=value: rule`` in one :class:`ConfigError`, identically on every rank.

Modules: :mod:`.sections` and :mod:`.schema` (the pydantic sections and :class:`TrainConfig`), :mod:`.overrides`
(``--section.key VALUE``), :mod:`.models` (model families, CP styles, LoRA targets, the model's transformers
config), :mod:`.presets` (shipped configs, data, tokenizers and tiny models) and :mod:`.load` (TOML + overrides +
every rule). The command line's ``--help`` lives in :mod:`sft_trainer.cli`.
"""

from sft_trainer.config.errors import ConfigError
from sft_trainer.config.load import check_config, config_from_dict, load_config, names_a_checkpoint, starting_data
from sft_trainer.config.models import (
    FAMILY_CP_STYLES,
    LAYER_CP_STYLES,
    LINEAR_NAMES,
    is_vision_language,
    model_family,
    resolve_model_config,
)
from sft_trainer.config.overrides import parse_overrides
from sft_trainer.config.presets import (
    CONFIGS_DIR,
    DEFAULT_CONFIG,
    PRESETS,
    SHIPPED_DATA,
    SHIPPED_MODEL_CONFIGS,
    SHIPPED_TOKENIZER,
    SHIPPED_VL_DATA,
    SHIPPED_VL_PROCESSOR,
    tiny_nemotron_h_config,
    tiny_qwen35_config,
    tiny_qwen35_vl_config,
)
from sft_trainer.config.schema import (
    CheckpointConfig,
    LoggingConfig,
    LoraConfig,
    TrainConfig,
    TrainingConfig,
    WandbConfig,
)
from sft_trainer.config.sections import DataConfig, ModelConfig, ParallelConfig

__all__ = [
    "CONFIGS_DIR",
    "DEFAULT_CONFIG",
    "FAMILY_CP_STYLES",
    "LAYER_CP_STYLES",
    "LINEAR_NAMES",
    "PRESETS",
    "SHIPPED_DATA",
    "SHIPPED_MODEL_CONFIGS",
    "SHIPPED_TOKENIZER",
    "SHIPPED_VL_DATA",
    "SHIPPED_VL_PROCESSOR",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "ParallelConfig",
    "TrainConfig",
    "TrainingConfig",
    "WandbConfig",
    "check_config",
    "config_from_dict",
    "is_vision_language",
    "load_config",
    "model_family",
    "names_a_checkpoint",
    "parse_overrides",
    "resolve_model_config",
    "starting_data",
    "tiny_nemotron_h_config",
    "tiny_qwen35_config",
    "tiny_qwen35_vl_config",
]
