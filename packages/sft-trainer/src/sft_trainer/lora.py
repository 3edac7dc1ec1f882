"""LoRA adapters on chosen linear layers: ``y = W x + (alpha / r) B A dropout(x)``, W frozen, B starts at zero.

Randomness: ``A``'s init comes from a generator seeded by the caller (the trainer: ``train.seed``), drawn on the
CPU in fp32 in module order, so every rank of any layout draws the same adapters; dropout draws from torch's
global generator, which the trainer seeds per rank with :func:`dropout_seed`."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable

import torch
import torch.nn as nn


def merged_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """``W + scale * B A``, computed in fp32 and returned in ``W``'s dtype."""
    return (weight.float() + scale * (lora_b.float() @ lora_a.float())).to(weight.dtype)


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update. ``merged()`` returns the equivalent plain Linear."""

    def __init__(
        self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0, generator: torch.Generator | None = None
    ):
        super().__init__()
        self.base = base
        self.base.requires_grad_(False)
        self.scale = alpha / rank
        self.lora_A = nn.Parameter(
            torch.empty(rank, base.in_features, dtype=base.weight.dtype, device=base.weight.device)
        )
        self.lora_B = nn.Parameter(
            torch.zeros(base.out_features, rank, dtype=base.weight.dtype, device=base.weight.device)
        )
        init = torch.empty(rank, base.in_features)  # on the CPU in fp32: the same draw whatever the device and dtype
        nn.init.kaiming_uniform_(init, a=math.sqrt(5), generator=generator)
        with torch.no_grad():
            self.lora_A.copy_(init)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (self.dropout(x) @ self.lora_A.t() @ self.lora_B.t()) * self.scale

    @torch.no_grad()
    def merged(self) -> nn.Linear:
        out = nn.Linear(self.base.in_features, self.base.out_features, bias=self.base.bias is not None)
        out = out.to(device=self.base.weight.device, dtype=self.base.weight.dtype)
        out.weight.copy_(merged_weight(self.base.weight, self.lora_A, self.lora_B, self.scale))
        if self.base.bias is not None:
            out.bias.copy_(self.base.bias)
        return out


def apply_lora(
    model: nn.Module,
    targets: Iterable[str],
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    seed: int | None = None,
) -> int:
    """Freeze ``model`` and put adapters on every ``nn.Linear`` whose attribute name is in ``targets``; with
    ``seed``, their ``A`` matrices come from a generator seeded with it (else from torch's global generator).

    Returns the number of adapted layers; raises if none matched (a typo would otherwise train nothing).
    """
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    targets = set(targets)
    model.requires_grad_(False)
    found = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name in targets and isinstance(child, nn.Linear):
                found.append(name)
                setattr(parent, name, LoRALinear(child, rank, alpha, dropout, generator))
    if not found:
        raise ValueError(f"train.lora.targets={sorted(targets)} matched no linear layer of {type(model).__name__}")
    return len(found)


def dropout_seed(seed: int, rank: int) -> int:
    """The global generator's seed on ``rank`` for dropout: fixed by (``seed``, rank), different across ranks
    (each rank masks different tokens or rows) and across seeds."""
    digest = hashlib.sha256(f"lora-dropout:{seed}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def merge_lora(model: nn.Module, keep_base: bool = False) -> nn.Module:
    """Replace every adapter by its merged Linear (or, with ``keep_base``, by its untouched base), in place."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LoRALinear):
                setattr(parent, name, child.base if keep_base else child.merged())
    return model


@torch.no_grad()
def split_lora_state(
    state: dict[str, torch.Tensor], scale: float, merge: bool
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A full model state dict with adapters -> (plain state dict, adapter tensors).

    The plain state has each adapted layer under its original name: ``W + scale * B A`` with ``merge``, else the
    untouched base ``W``. Works on gathered (FSDP) state dicts, where the modules themselves hold only shards.
    """
    adapters = {n: t for n, t in state.items() if n.endswith((".lora_A", ".lora_B"))}
    adapted = {n[: -len(".lora_A")] for n in adapters if n.endswith(".lora_A")}
    plain = {}
    for name, tensor in state.items():
        if name in adapters:
            continue
        layer, _, leaf = name.rpartition(".base.")
        plain[f"{layer}.{leaf}" if layer in adapted else name] = tensor
    if merge:
        for layer in adapted:
            lora_a, lora_b = adapters[layer + ".lora_A"], adapters[layer + ".lora_B"]
            plain[layer + ".weight"] = merged_weight(plain[layer + ".weight"], lora_a, lora_b, scale)
    return plain, adapters
