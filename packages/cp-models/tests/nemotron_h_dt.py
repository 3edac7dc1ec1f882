"""Mamba-2 ``dt_bias`` drawn as transformers initializes it, for tests that must see the time-step clamp act."""

from __future__ import annotations

import math

import torch


def draw_dt_bias(config, heads: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Inverse softplus of dt drawn log-uniformly in [time_step_min, time_step_max] (floored at
    time_step_floor), as transformers' init does. When ``time_step_limit`` has a positive lower bound, every third
    head is put under it (softplus(dt_bias) in 10-90 % of the bound), so the clamp holds those heads at the bound.
    Without a generator, torch's global one draws."""
    low, high = math.log(config.time_step_min), math.log(config.time_step_max)
    dt = torch.exp(torch.rand(heads, generator=generator) * (high - low) + low).clamp(min=config.time_step_floor)
    bound = float(config.time_step_limit[0])
    if bound > 0:
        under = torch.arange(heads) % 3 == 0
        dt[under] = bound * (0.1 + 0.8 * torch.rand(int(under.sum()), generator=generator))
    return dt + torch.log(-torch.expm1(-dt))  # inverse softplus
