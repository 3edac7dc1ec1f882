"""The RMSNorms of the models: zero-centered (Qwen3.5; our Triton kernels on CUDA) and gated (GDN's output, Mamba-2's
grouped one; flash-linear-attention's fused kernel on CUDA), each beside its torch reference."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from cp_core import RecurrentBackend, resolve_recurrent_backend
from cp_models.triton_support import own_kernels_apply


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm with weight stored as an offset from 1 (``x / rms(x) * (1 + w)``), computed in fp32.

    On CUDA (any ``backend`` but "torch") one Triton kernel each way (:mod:`cp_models.norm_triton`: fixed configs,
    nothing to autotune), which keeps only ``x`` and the per-row rstd for backward; :meth:`reference` is the torch
    path everywhere else.
    """

    def __init__(self, dim: int, eps: float = 1e-6, backend: RecurrentBackend = "auto"):
        super().__init__()
        self.eps, self.backend = eps, backend
        self.weight = nn.Parameter(torch.zeros(dim))

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)

    def fused_on(self, x: torch.Tensor) -> bool:
        """Whether tensors like ``x`` run the fused kernels (else the reference)."""
        return own_kernels_apply(self.backend, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_on(x):
            from cp_models.norm_triton import ZeroCenteredRMSNormFunction

            return ZeroCenteredRMSNormFunction.apply(x, self.weight, self.eps)
        return self.reference(x)


class GatedRMSNorm(nn.Module):
    """``w * x / rms(x) * silu(z)`` over the last dim (optionally in groups of ``group_size``; with
    ``norm_before_gate=False`` the gate multiplies first, as in Mamba-2).

    On CUDA with flash-linear-attention one fused kernel each way (fla's grouped, gated RMSNorm); :meth:`reference`
    is the torch path everywhere else.
    """

    def __init__(
        self,
        dim: int,
        eps: float = 1e-6,
        group_size: int | None = None,
        norm_before_gate: bool = True,
        backend: RecurrentBackend = "auto",
    ):
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size or dim, norm_before_gate
        self.backend = backend
        self.weight = nn.Parameter(torch.ones(dim))

    def reference(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        y = x.float()
        if not self.norm_before_gate:
            y = y * F.silu(gate.float())
        grouped = y.unflatten(-1, (-1, self.group_size))
        y = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        y = self.weight * y.to(dtype)
        if self.norm_before_gate:
            y = y * F.silu(gate.float())
        return y.to(dtype)

    def fused_on(self, x: torch.Tensor) -> bool:
        """Whether tensors like ``x`` run the fused kernel (else the reference)."""
        return resolve_recurrent_backend(self.backend, x, "norm") == "fla"

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.fused_on(x):
            from fla.modules.norm.layernorm_gated import rmsnorm_fn

            group = None if self.group_size == x.size(-1) else self.group_size
            return rmsnorm_fn(
                x, self.weight, None, z=gate, eps=self.eps, group_size=group, norm_before_gate=self.norm_before_gate
            )
        return self.reference(x, gate)
