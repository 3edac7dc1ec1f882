"""True fp64 runs: a model's ``.float()`` upcasts left as no-ops, so an fp64 comparison is not capped at fp32."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.overrides import TorchFunctionMode


class KeepFloat64(TorchFunctionMode):
    """``Tensor.float()`` leaves float64 tensors as they are (a model's fp32 upcasts become no-ops in fp64)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.float and args[0].dtype == torch.float64:
            return args[0]
        return func(*args, **(kwargs or {}))


def _enter_keep_float64(module: torch.nn.Module, args) -> None:
    mode = KeepFloat64()
    mode.__enter__()
    module.__dict__.setdefault("_keep_float64_modes", []).append(mode)


def _exit_keep_float64(module: torch.nn.Module, args, output) -> None:
    module.__dict__["_keep_float64_modes"].pop().__exit__(None, None, None)


def keep_float64_(model: torch.nn.Module, layers: Iterable[torch.nn.Module] = ()) -> torch.nn.Module:
    """Run ``model`` (already ``.double()``) in true fp64: models compute norms, decays and routers in fp32
    (``.float()``), which would cap an fp64 comparison at fp32 rounding. Hooks on ``model`` and on each of ``layers``
    (pass the activation-checkpointed blocks, so that their recomputation in backward is covered too) make those
    casts no-ops. An fp64 comparison separates a CP bug (any size) from fp32 rounding amplified by cancellation."""
    for module in (model, *layers):
        module.register_forward_pre_hook(_enter_keep_float64)
        module.register_forward_hook(_exit_keep_float64)
    return model
