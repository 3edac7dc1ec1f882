"""``sft-train plan``: what a run will send and hold per rank, and the longest row that fits, before anything starts.

From the validated :class:`~sft_trainer.config.TrainConfig` and nothing bigger than the model's config, it reports

1. per layer type: how many there are, the CP strategy at this ``cp`` (attention: Ulysses, all-gathered KV or
   ring-passed KV, ``parallel.attention_cp``), and the bytes each rank sends per row (forward + backward, the busiest rank, one
   document spanning the row), with totals, the state-passing / all-to-all / all-gather shares and the time at a
   stated NVLink bandwidth;
2. the memory per rank (parameters, gradients, AdamW state, activations, backward workspace, headroom) with and
   without activation checkpointing;
3. the longest ``data.seq_len`` that fits the GPU at this ``cp`` and at every valid cp in 1, 2, 4, ..., 64;
4. the reason, with the numbers that fix it, when the run cannot work.

The byte counts are exact closed forms of what cp_core's collectives send (tests compare them with
``cp_core.testing.CommCounter``). The memory model is a per-layer-type count of the tensors the fast CUDA path
(fla kernels, varlen attention, grouped-GEMM MoE, the tiled loss) keeps for backward; every coefficient lives in
:mod:`.coefficients` (:data:`ACTIVATION_COEFFICIENTS` and a few smaller tables), so they can be calibrated against measurements.

Modules: :mod:`.coefficients` (the calibrated tables), :mod:`.traffic` (bytes sent), :mod:`.parameters` (model
structure and parameter counts), :mod:`.activations` and :mod:`.memory` (memory per rank, the longest row),
:mod:`.validity` (which cp a model allows), :mod:`.build` (a config's plan) and :mod:`.format` (the printed table).
"""

from sft_trainer.plan.activations import (
    PLAIN_MLP_EXTRA_SAVED,
    activation_bytes_per_token,
    layer_widths,
    loss_workspace_bytes,
)
from sft_trainer.plan.build import build_plan, tokenizer_vocab
from sft_trainer.plan.coefficients import (
    ACTIVATION_COEFFICIENTS,
    DTYPE_BYTES,
    FLA_CHUNK,
    FSDP_GATHERED_BLOCKS,
    FSDP_GRADIENT_BLOCKS,
    GIB,
    H200_GIB,
    HEADROOM,
    LOSS_COEFFICIENTS,
    NVLINK_GBPS,
    PLANNED_CPS,
)
from sft_trainer.plan.format import format_plan, format_size
from sft_trainer.plan.memory import MemoryEstimate, estimate_memory, longest_seq_len
from sft_trainer.plan.parameters import ParameterCount, count_parameters, layer_kinds
from sft_trainer.plan.traffic import (
    gdn_bytes,
    kv_gather_attention_bytes,
    kv_ring_attention_bytes,
    mamba_bytes,
    ulysses_attention_bytes,
)
from sft_trainer.plan.validity import attention_strategy, valid_cp

__all__ = [
    "ACTIVATION_COEFFICIENTS",
    "DTYPE_BYTES",
    "FLA_CHUNK",
    "FSDP_GATHERED_BLOCKS",
    "FSDP_GRADIENT_BLOCKS",
    "GIB",
    "H200_GIB",
    "HEADROOM",
    "LOSS_COEFFICIENTS",
    "NVLINK_GBPS",
    "PLAIN_MLP_EXTRA_SAVED",
    "PLANNED_CPS",
    "MemoryEstimate",
    "ParameterCount",
    "activation_bytes_per_token",
    "attention_strategy",
    "build_plan",
    "count_parameters",
    "estimate_memory",
    "format_plan",
    "format_size",
    "gdn_bytes",
    "kv_gather_attention_bytes",
    "kv_ring_attention_bytes",
    "layer_kinds",
    "layer_widths",
    "longest_seq_len",
    "loss_workspace_bytes",
    "mamba_bytes",
    "tokenizer_vocab",
    "ulysses_attention_bytes",
    "valid_cp",
]
