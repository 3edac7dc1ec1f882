"""The rules a model config's sizes and constants follow, checked when a model is built (and by a trainer before
it starts workers): a head count of 0, a negative epsilon or a rotary fraction above 1 otherwise surfaces as a
shape error deep inside a forward, or as a loss of nan."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from cp_core import ContextParallelError

MAX_SIZE = 2**24
"""Above any width, vocabulary or expert count of a real model: a larger size is a typo, not a model."""
MAX_LAYERS = 10_000
# (multiple, divisor): where a config sets both, the first is a multiple of the second
MULTIPLES = (
    ("num_attention_heads", "num_key_value_heads"),
    ("linear_num_value_heads", "linear_num_key_heads"),
    ("mamba_num_heads", "n_groups"),
    ("n_routed_experts", "n_group"),
)
# (at most, at least): where a config sets both, the first is at most the second
AT_MOST = (
    ("num_experts_per_tok", "num_experts"),
    ("num_experts_per_tok", "n_routed_experts"),
    ("topk_group", "n_group"),
)
EPSILONS = ("rms_norm_eps", "layer_norm_epsilon")


def multiple_problem(config: Any, multiple: str, divisor: str) -> str | None:
    """Why ``config``'s ``multiple`` is not a multiple of its ``divisor``, or None (also where either is unset)."""
    a, b = getattr(config, multiple, None), getattr(config, divisor, None)
    if a is not None and b is not None and a % b:
        return f"{multiple}={a} must be a multiple of {divisor}={b}"
    return None


def check_multiple(config: Any, multiple: str, divisor: str) -> None:
    """Raises :class:`ContextParallelError` with :func:`multiple_problem`'s line (a layer built on its own)."""
    if problem := multiple_problem(config, multiple, divisor):
        raise ContextParallelError(problem)


def size_problem(name: str, value: Any) -> str | None:
    """Why ``value`` is not a size ``name`` may take (a positive integer up to its limit), or None."""
    if value is None:
        return None
    if type(value) is not int or value < 1:
        return f"{name}={value!r}: must be a positive integer"
    limit = MAX_LAYERS if name == "num_hidden_layers" else MAX_SIZE
    if value > limit:
        return f"{name}={value}: must be at most {limit} (a larger value is not a model this library trains)"
    return None


def _routing_group_problems(config: Any) -> list[str]:
    """Grouped routing (``n_group`` > 1) scores a group by its two best experts and picks the top-k among the
    ``topk_group`` best groups' experts: each group needs two experts, and the chosen groups hold the top-k."""
    groups, experts = getattr(config, "n_group", None), getattr(config, "n_routed_experts", None)
    top_k, top_groups = getattr(config, "num_experts_per_tok", None), getattr(config, "topk_group", None)
    if not groups or groups <= 1 or not experts or experts % groups:
        return []
    per_group = experts // groups
    if per_group < 2:
        return [
            f"n_routed_experts={experts} in n_group={groups} groups is {per_group} expert a group: grouped routing "
            "scores a group by its two best experts; use n_group <= n_routed_experts / 2"
        ]
    if top_k is not None and top_groups is not None and top_k > top_groups * per_group:
        return [
            f"num_experts_per_tok={top_k} must be at most topk_group={top_groups} x {per_group} experts a group "
            f"(n_routed_experts={experts} / n_group={groups}): the top-k is chosen within the best groups only"
        ]
    return []


def _rope_problems(config: Any) -> list[str]:
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None)) if isinstance(rope, dict) else None
    problems = []
    if theta is not None and not (isinstance(theta, int | float) and math.isfinite(theta) and theta > 0):
        problems.append(f"rope_theta={theta!r}: must be a finite number > 0")
    factor = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    head_dim = getattr(config, "head_dim", None)
    if factor is not None:
        if not (isinstance(factor, int | float) and 0 < factor <= 1):
            problems.append(f"partial_rotary_factor={factor!r}: must be in (0, 1] (the rotated share of a head)")
        elif isinstance(head_dim, int) and int(head_dim * factor) % 2:
            problems.append(
                f"partial_rotary_factor={factor} of head_dim={head_dim} rotates {int(head_dim * factor)} dims: must "
                "be an even number (rotary pairs)"
            )
    return problems


def config_problems(config: Any, positive: Iterable[str]) -> list[str]:
    """One line per broken rule of ``config``: each field of ``positive`` the config sets (not None) is a positive
    integer of a plausible size, the layer list is not empty, head and group counts divide (:data:`MULTIPLES`),
    a token picks at most all experts (:data:`AT_MOST`) and grouped routing has the experts it picks from, norm
    epsilons are finite and >= 0, and the rotary base and fraction are in range."""
    problems = [p for name in positive if (p := size_problem(name, getattr(config, name, None)))]
    if problems:
        return problems
    for name in ("layer_types", "layers_block_type"):
        layers = getattr(config, name, None)
        if layers is not None and len(layers) == 0:
            problems.append(f"{name}=[]: the model has no layers")
    problems += [p for pair in MULTIPLES if (p := multiple_problem(config, *pair))]
    for small, large in AT_MOST:
        a, b = getattr(config, small, None), getattr(config, large, None)
        if a is not None and b is not None and a > b:
            problems.append(f"{small}={a} must be at most {large}={b}")
    for name in EPSILONS:
        eps = getattr(config, name, None)
        if eps is not None and not (isinstance(eps, int | float) and math.isfinite(eps) and eps >= 0):
            problems.append(f"{name}={eps!r}: must be a finite number >= 0")
    if not problems:  # the group arithmetic needs the sizes and multiples above to hold
        problems += _routing_group_problems(config)
    return problems + _rope_problems(config)


def check_config_rules(config: Any, positive: Iterable[str]) -> None:
    """Raises :class:`ContextParallelError` with every problem :func:`config_problems` finds."""
    problems = config_problems(config, positive)
    if problems:
        raise ContextParallelError(f"{config.model_type} config: {'; '.join(problems)}")
