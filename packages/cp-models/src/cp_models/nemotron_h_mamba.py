"""Nemotron-H's Mamba-2 mixer under context parallelism, one of two strategies per model (``mamba_cp_style``):

- ``"state_passing"``: stay sequence-sharded; the conv gets the previous rank's last ``W-1`` inputs
  (cp_core.causal_conv1d_cp) and the SSD scan gets its initial state from the previous rank (cp_core.ssd_cp).
  No head or group constraint; traffic per layer independent of the sequence length.
- ``"a2a"``: head-parallel; one all-to-all takes x, B, C and dt to ``[S, heads/cp]``, conv and scan run over
  the whole row for this rank's heads (parameters sliced at run time), one all-to-all brings y back. Needs
  ``cp | mamba_num_heads`` and ``cp | n_groups`` or ``n_groups | cp`` (groups replicated).

The rest of the model (attention, MLP, MoE, blocks, HF checkpoints) is in :mod:`cp_models.nemotron_h`.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from cp_core import (
    ContextParallelError,
    PackedRowMetadata,
    RecurrentBackend,
    causal_conv1d,
    causal_conv1d_cp,
    heads_to_sequence,
    ssd,
    ssd_cp,
)
from cp_core.head_parallel import check_head_parallel, fused_sequence_to_heads, local_groups, local_heads
from cp_core.numerics import upcast
from cp_models.activations import activation
from cp_models.config_rules import check_multiple
from cp_models.context_parallel import ContextParallelModule
from cp_models.norms import GatedRMSNorm

MambaCPStyle = Literal["state_passing", "a2a"]
MAMBA_CP_STYLES: tuple[str, ...] = ("state_passing", "a2a")


def _time_step_limit(config) -> tuple[float, float]:
    """``config.time_step_limit`` as ``(low, high)``: the bounds every Mamba layer clamps its time steps to."""
    try:
        limit = tuple(float(v) for v in config.time_step_limit)
    except (TypeError, ValueError):
        limit = ()
    if len(limit) != 2 or not 0.0 <= limit[0] <= limit[1]:
        raise ContextParallelError(
            f"time_step_limit={config.time_step_limit!r} must be [low, high] with 0 <= low <= high "
            "(the released configs use [0.0, inf])"
        )
    return limit


class NemotronHMamba2Mixer(ContextParallelModule):
    """Mamba-2: in_proj -> (z, x|B|C, dt); causal depthwise conv over x|B|C; SSD scan with D skip; RMSNorm of
    ``y * silu(z)`` in groups of ``intermediate / n_groups``; out_proj.

    ``dt = clamp(softplus(dt + dt_bias), *time_step_limit)``, as transformers >= 5.25 and mamba-ssm's ``dt_limit``
    do (``(0, inf)``, the released configs' value, clamps nothing); ``time_step_min`` and ``time_step_max`` only
    shape the initialization of ``dt_bias``. transformers 5.17-5.24 clamp to ``(time_step_min, inf)`` instead.
    """

    def __init__(self, config, recurrent_backend: RecurrentBackend = "auto", cp_style: MambaCPStyle = "state_passing"):
        super().__init__()
        if cp_style not in MAMBA_CP_STYLES:
            raise ContextParallelError(f"unknown mamba_cp_style {cp_style!r}; choose one of {MAMBA_CP_STYLES}")
        self.num_heads, self.head_dim = config.mamba_num_heads, config.mamba_head_dim
        self.n_groups, self.state_size = config.n_groups, config.ssm_state_size
        self.intermediate_size = self.num_heads * self.head_dim
        check_multiple(config, "mamba_num_heads", "n_groups")
        self.conv_dim = self.intermediate_size + 2 * self.n_groups * self.state_size
        self.time_step_limit = _time_step_limit(config)
        self.recurrent_backend, self.cp_style = recurrent_backend, cp_style
        # silu is fused into the conv primitives; any other activation is applied after a linear conv.
        act = config.mamba_hidden_act
        self.conv_activation = "silu" if act in ("silu", "swish") else None
        self.post_conv_act = None if self.conv_activation else activation(act)

        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, self.num_heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        width = config.conv_kernel
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, width, groups=self.conv_dim, padding=width - 1, bias=config.use_conv_bias
        )
        self.in_proj = nn.Linear(
            config.hidden_size, self.intermediate_size + self.conv_dim + self.num_heads, bias=config.use_bias
        )
        self.norm = GatedRMSNorm(
            self.intermediate_size,
            eps=config.layer_norm_epsilon,
            group_size=self.intermediate_size // self.n_groups,
            norm_before_gate=False,
            backend=recurrent_backend,
        )
        self.out_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=config.use_bias)

    def check_context_parallel(self, cp_size: int) -> None:
        if self.cp_style == "a2a":
            check_head_parallel(self.num_heads, self.n_groups, cp_size, what="Mamba-2 head-parallel (a2a) CP")

    def forward(self, hidden: torch.Tensor, meta: PackedRowMetadata) -> torch.Tensor:
        t = hidden.size(0)
        gate, xbc, dt = self.in_proj(hidden).split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        if self.cp_style == "a2a" and self.cp_topology.enabled:
            y = self._head_parallel(xbc, dt, meta)
        else:
            y = self._sequence_parallel(xbc, dt, meta)
        # The gated norm runs here, on this rank's tokens at full width, under both strategies: its groups span
        # intermediate/n_groups channels, which a rank's heads cover only partly when n_groups < cp, so the
        # head-parallel layout could not normalize exactly. Done here it is exact, and z never travels.
        y = self.norm(y.reshape(t, self.intermediate_size), gate)
        return self.out_proj(y)

    def _activate(self, xbc: torch.Tensor) -> torch.Tensor:
        return xbc if self.post_conv_act is None else self.post_conv_act(xbc)

    def _discretize(self, dt: torch.Tensor, heads: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """(dt [T, h], A [h]) of the given heads, in fp32 (fp64 stays fp64)."""
        dt = F.softplus(upcast(dt) + upcast(self.dt_bias[heads]))
        low, high = self.time_step_limit
        return torch.clamp(dt, min=low, max=high), -torch.exp(upcast(self.A_log[heads]))

    def _sequence_parallel(self, xbc: torch.Tensor, dt: torch.Tensor, meta: PackedRowMetadata) -> torch.Tensor:
        """Sequence-sharded: conv halo + SSD state passing. Returns y [T, H, P]."""
        t, groups_width = xbc.size(0), self.n_groups * self.state_size
        xbc = causal_conv1d_cp(
            xbc,
            self.conv1d.weight.squeeze(1),
            self.conv1d.bias,
            meta,
            self.cp_topology,
            activation=self.conv_activation,
            backend=self.recurrent_backend,
        )
        x, B, C = self._activate(xbc).split([self.intermediate_size, groups_width, groups_width], dim=-1)
        dt, A = self._discretize(dt, slice(None))
        return ssd_cp(
            x.reshape(t, self.num_heads, self.head_dim),
            dt,
            A,
            B.reshape(t, self.n_groups, self.state_size),
            C.reshape(t, self.n_groups, self.state_size),
            meta,
            self.cp_topology,
            D=self.D,
            backend=self.recurrent_backend,
        )

    def _head_parallel(self, xbc: torch.Tensor, dt: torch.Tensor, meta: PackedRowMetadata) -> torch.Tensor:
        """Head-parallel: one all-to-all to [S, heads/cp], conv + SSD over the whole row, one all-to-all back."""
        topology = self.cp_topology
        t, groups_width = xbc.size(0), self.n_groups * self.state_size
        x, B, C = xbc.split([self.intermediate_size, groups_width, groups_width], dim=-1)
        # B and C are replicated before the exchange when n_groups < cp (each rank gets the group its heads read).
        x, B, C, dt = fused_sequence_to_heads(
            [
                x.reshape(t, self.num_heads, self.head_dim),
                B.reshape(t, self.n_groups, self.state_size),
                C.reshape(t, self.n_groups, self.state_size),
                dt.reshape(t, self.num_heads, 1),
            ],
            topology,
            replicate=[False, True, True, False],
        )
        s, local_h, local_g = x.size(0), x.size(1), B.size(1)
        heads, groups = local_heads(self.num_heads, topology), local_groups(self.n_groups, topology)
        # This rank's conv channels: its heads' x channels, its groups' B and C channels.
        p, n, i = self.head_dim, self.state_size, self.intermediate_size
        channels = [
            slice(heads.start * p, heads.stop * p),
            slice(i + groups.start * n, i + groups.stop * n),
            slice(i + groups_width + groups.start * n, i + groups_width + groups.stop * n),
        ]
        weight = self.conv1d.weight.squeeze(1)
        bias = self.conv1d.bias
        local = torch.cat([x.reshape(s, -1), B.reshape(s, -1), C.reshape(s, -1)], dim=-1)
        bounds = meta.kernel_bounds(local.device).row  # the row's, built once per forward for every layer
        # The whole row is here: a plain conv with the global document boundaries (no halo).
        local = causal_conv1d(
            local,
            torch.cat([weight[c] for c in channels]),
            None if bias is None else torch.cat([bias[c] for c in channels]),
            self.conv_activation,
            seq_lens=meta.seq_lens,
            backend=self.recurrent_backend,
            bounds=bounds,
        )
        x, B, C = self._activate(local).split([local_h * p, local_g * n, local_g * n], dim=-1)
        dt, A = self._discretize(dt.reshape(s, local_h), heads)
        y, _ = ssd(
            x.reshape(s, local_h, p),
            dt,
            A,
            B.reshape(s, local_g, n),
            C.reshape(s, local_g, n),
            seq_lens=meta.seq_lens,
            D=self.D[heads],
            backend=self.recurrent_backend,
            bounds=bounds,
            final_states="last",  # unused: spares mamba-ssm's path the earlier documents' closed forms
        )
        return heads_to_sequence(y, topology)
