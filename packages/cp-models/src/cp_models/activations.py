"""The activations Nemotron-H configs name, as modules."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class ReLUSquared(nn.Module):
    """``relu(x)^2`` (transformers' ``"relu2"``, the MLP and expert activation of the released models)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x).square()


# The activations configs use, with transformers' semantics; importing transformers.activations costs seconds
# (it pulls in the hub-kernel machinery), so anything else is looked up there only when a config asks for it.
ACTIVATIONS = {
    "relu2": ReLUSquared,
    "relu": nn.ReLU,
    "silu": nn.SiLU,
    "swish": nn.SiLU,
    "gelu": nn.GELU,
    "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
}


def activation(name: str) -> nn.Module:
    """The activation module a config names, with transformers' semantics."""
    if name in ACTIVATIONS:
        return ACTIVATIONS[name]()
    from transformers.activations import ACT2FN

    return ACT2FN[name]
