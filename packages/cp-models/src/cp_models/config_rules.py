"""The rules a model config's sizes follow, checked when a model is built (and by a trainer before it starts
workers): a head count of 0 or a negative width otherwise surfaces as a shape error deep inside a forward."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from cp_core import ContextParallelError


def config_size_problems(config: Any, positive: Iterable[str]) -> list[str]:
    """One line per broken rule of ``config``: each field of ``positive`` the config sets (not None) is a positive
    integer, the query heads are a multiple of the key/value heads, and a token picks at most all experts."""
    problems = []
    for name in positive:
        value = getattr(config, name, None)
        if value is not None and (type(value) is not int or value < 1):
            problems.append(f"{name}={value!r}: must be a positive integer")
    if problems:
        return problems
    heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if heads is not None and kv_heads is not None and heads % kv_heads:
        problems.append(f"num_attention_heads={heads} must be a multiple of num_key_value_heads={kv_heads}")
    experts = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if experts is not None and top_k is not None and top_k > experts:
        problems.append(f"num_experts_per_tok={top_k} must be at most the number of experts ({experts})")
    return problems


def check_config_sizes(config: Any, positive: Iterable[str]) -> None:
    """Raises :class:`ContextParallelError` with every problem :func:`config_size_problems` finds."""
    problems = config_size_problems(config, positive)
    if problems:
        raise ContextParallelError(f"{config.model_type} config: {'; '.join(problems)}")
