"""Context-parallel supervised fine-tuning of hybrid and vision-language models.

The public API, one import away: a run's validated config (:func:`load_config`, :class:`TrainConfig`), its plan
before anything starts (:func:`build_plan`, :func:`format_plan`, :func:`estimate_memory`), the model it trains
(:func:`build_model` = :func:`create_model` + :func:`parallelize_model`) and the ``sft-train`` command
(:func:`main`; ``python -m sft_trainer.run`` under torchrun). docs/sft-trainer.md describes them,
docs/architecture.md the modules.
"""

import importlib
from typing import Any

# name -> module; imported on first use, so that a process needing one submodule (a tokenizing worker imports
# sft_trainer.data.tokenize) does not import torch, the config and the model stack with this package
_EXPORTS = {
    "main": "sft_trainer.cli",
    **dict.fromkeys(("ConfigError", "TrainConfig", "config_from_dict", "load_config"), "sft_trainer.config"),
    **dict.fromkeys(("build_model", "create_model"), "sft_trainer.model"),
    "parallelize_model": "sft_trainer.parallelize",
    **dict.fromkeys(("build_plan", "estimate_memory", "format_plan"), "sft_trainer.plan"),
}

__version__ = "0.1.0"

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'sft_trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
