"""Context-parallel supervised fine-tuning of hybrid and vision-language models.

The public API, one import away: a run's validated config (:func:`load_config`, :class:`TrainConfig`), its plan
before anything starts (:func:`build_plan`, :func:`format_plan`, :func:`estimate_memory`), the model it trains
(:func:`build_model` = :func:`create_model` + :func:`parallelize_model`) and the ``sft-train`` command
(:func:`main`; ``python -m sft_trainer.run`` under torchrun). docs/sft-trainer.md describes them,
docs/architecture.md the modules.
"""

from sft_trainer.cli import main
from sft_trainer.config import ConfigError, TrainConfig, config_from_dict, load_config
from sft_trainer.model import build_model, create_model
from sft_trainer.parallelize import parallelize_model
from sft_trainer.plan import build_plan, estimate_memory, format_plan

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "TrainConfig",
    "build_model",
    "build_plan",
    "config_from_dict",
    "create_model",
    "estimate_memory",
    "format_plan",
    "load_config",
    "main",
    "parallelize_model",
]
