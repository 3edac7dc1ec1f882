"""cp_core: context-parallel primitives for packed rows (torch only).

The pieces, in the order one packed row meets them:

- :class:`CPTopology`: the process group that shards the sequence, and this rank's place in it.
- :func:`build_packed_metadata`: global document lengths -> global and per-rank boundaries.
- :func:`shard_sequence` / :func:`gather_sequence`: contiguous sharding and its autograd inverse
  (also for [B, S] position ids and [3, B, S] MRoPE positions).
- :func:`ulysses_attention`: all-to-all sequence parallelism around varlen causal attention
  (:func:`varlen_causal_attention`, with torch, torch-varlen and flash-attn backends); for any cp
  :func:`kv_gather_attention` (all-gathered keys and values) and :func:`kv_ring_attention` (keys and values passed
  around the ring: memory that does not grow with the row); :func:`context_parallel_attention` runs any of them.
- Recurrent layers: :func:`causal_conv1d_cp` (halo exchange with document resets), :func:`ssd_cp` (Mamba-2) and
  :func:`gated_delta_rule_cp` (Gated DeltaNet), exact by passing states down the ranks (:func:`pass_states`);
  torch paths everywhere, flash-linear-attention kernels on CUDA when installed.
- Head-parallel recurrences (:mod:`cp_core.head_parallel`): the Ulysses all-to-all for Mamba-2's heads and B/C
  groups (split when cp divides the groups, replicated when the groups divide cp).
"""

from cp_core.attention_styles import (
    ATTENTION_CP_STYLES,
    AUTO_RING_FROM_CP,
    AttentionCPStyle,
    context_parallel_attention,
    resolve_attention_cp_style,
)
from cp_core.conv import causal_conv1d, causal_conv1d_cp, exchange_halo, naive_causal_conv1d
from cp_core.errors import ContextParallelError
from cp_core.gated_delta import (
    GatedDecay,
    chunk_gated_delta_rule_torch,
    gated_delta_rule,
    gated_delta_rule_cp,
    naive_recurrent_gated_delta_rule,
)
from cp_core.head_parallel import check_head_parallel, fused_sequence_to_heads, local_groups, local_heads
from cp_core.kv_gather import gather_kv, kv_gather_attention
from cp_core.kv_ring import kv_ring_attention
from cp_core.packing import (
    PackedRowMetadata,
    build_packed_metadata,
    check_divisible,
    cu_seqlens_from_lens,
    normalize_seq_lens,
    position_ids_from_seq_lens,
)
from cp_core.recurrent_backends import RecurrentBackend, fla_backward_problem, resolve_recurrent_backend
from cp_core.sharding import (
    check_same_row_on_every_rank,
    gather_sequence,
    gather_variable,
    shard_mrope_positions,
    shard_position_ids,
    shard_sequence,
)
from cp_core.ssd import chunk_ssd_torch, naive_recurrent_ssd, ssd, ssd_cp
from cp_core.state_passing import pass_states
from cp_core.topology import CPTopology
from cp_core.ulysses import (
    check_ulysses_heads,
    heads_to_sequence,
    qkv_sequence_to_heads,
    replicate_kv_heads,
    sequence_to_heads,
    ulysses_attention,
)
from cp_core.varlen_attention import AttentionBackend, resolve_attention_backend, varlen_causal_attention

__version__ = "0.1.0"

__all__ = [
    "ATTENTION_CP_STYLES",
    "AUTO_RING_FROM_CP",
    "AttentionBackend",
    "AttentionCPStyle",
    "CPTopology",
    "ContextParallelError",
    "GatedDecay",
    "PackedRowMetadata",
    "RecurrentBackend",
    "build_packed_metadata",
    "causal_conv1d",
    "causal_conv1d_cp",
    "check_divisible",
    "check_head_parallel",
    "check_same_row_on_every_rank",
    "check_ulysses_heads",
    "chunk_gated_delta_rule_torch",
    "chunk_ssd_torch",
    "context_parallel_attention",
    "cu_seqlens_from_lens",
    "exchange_halo",
    "fla_backward_problem",
    "fused_sequence_to_heads",
    "gated_delta_rule",
    "gated_delta_rule_cp",
    "gather_kv",
    "gather_sequence",
    "gather_variable",
    "heads_to_sequence",
    "kv_gather_attention",
    "kv_ring_attention",
    "local_groups",
    "local_heads",
    "naive_causal_conv1d",
    "naive_recurrent_gated_delta_rule",
    "naive_recurrent_ssd",
    "normalize_seq_lens",
    "pass_states",
    "position_ids_from_seq_lens",
    "qkv_sequence_to_heads",
    "replicate_kv_heads",
    "resolve_attention_backend",
    "resolve_attention_cp_style",
    "resolve_recurrent_backend",
    "sequence_to_heads",
    "shard_mrope_positions",
    "shard_position_ids",
    "shard_sequence",
    "ssd",
    "ssd_cp",
    "ulysses_attention",
    "varlen_causal_attention",
]
