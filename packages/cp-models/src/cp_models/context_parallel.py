"""CP wiring of a model: the base classes of the layers that mix tokens, and the one call that hands every such
layer the model's CP topology and attention strategy."""

from __future__ import annotations

import torch
import torch.nn as nn

from cp_core import (
    AttentionBackend,
    AttentionCPStyle,
    ContextParallelError,
    CPTopology,
    PackedRowMetadata,
    context_parallel_attention,
    resolve_attention_cp_style,
)


class ContextParallelModule(nn.Module):
    """A layer that mixes tokens and knows how to do it under CP. ``cp_topology`` is set once per model by
    :func:`set_context_parallel_attributes`; per-batch boundaries arrive as forward arguments."""

    cp_topology: CPTopology = CPTopology.single()

    def check_context_parallel(self, cp_size: int) -> None:
        """Raise if this layer cannot run with ``cp_size`` ranks (e.g. a head-count rule)."""


class ContextParallelAttention(ContextParallelModule):
    """Softmax attention under CP, by Ulysses or by all-gathered or ring-passed keys and values
    (``attention_cp_style``, resolved once per model by :func:`set_context_parallel_attributes`). Subclasses set
    ``num_heads``, ``num_kv_heads`` and ``attention_backend`` and call :meth:`attend`."""

    num_heads: int
    num_kv_heads: int
    attention_backend: AttentionBackend = "auto"
    attention_cp_style: str = "ulysses"

    def resolve_attention_cp_style(self, style: str, cp_size: int) -> str:
        return resolve_attention_cp_style(style, self.num_heads, self.num_kv_heads, cp_size)

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        meta: PackedRowMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        return context_parallel_attention(
            query,
            key,
            value,
            meta,
            self.cp_topology,
            self.attention_cp_style,
            scale=scale,
            sliding_window=sliding_window,
            backend=self.attention_backend,
        )


def set_context_parallel_attributes(
    model: nn.Module, topology: CPTopology, *, attention_cp_style: AttentionCPStyle = "ulysses"
) -> CPTopology:
    """Set the CP ``topology`` on every token-mixing layer of ``model`` (through activation-checkpoint wrappers).

    ``attention_cp_style`` picks how softmax attention splits: "ulysses" (the default: all-to-all over heads, even
    work; cp must divide the query heads), "kv_gather" (all-gathered keys and values; any cp), "kv_ring" (keys and
    values passed around the ring; any cp, memory that does not grow with the row) or "auto" (Ulysses where its
    head rule holds, else all-gathered KV below ``cp_core.AUTO_RING_FROM_CP`` ranks and the ring from there).

    Validates every layer for ``topology.size`` first (head rules), so nothing is half-configured on error. Raises
    :class:`ContextParallelError` for a model containing token-mixing modules that have no CP implementation.
    """
    if not isinstance(topology, CPTopology):
        raise ContextParallelError(
            f"set_context_parallel_attributes takes a cp_core.CPTopology, got {type(topology).__name__}: build one "
            "with CPTopology.from_group(group), CPTopology.from_mesh(mesh) or CPTopology.single()"
        )
    cp_layers = [m for m in model.modules() if isinstance(m, ContextParallelModule)]
    if not cp_layers:
        raise ContextParallelError(
            f"{type(model).__name__} has no context-parallel layers; use a cp_models model (e.g. "
            "cp_models.Qwen35ForCausalLM.from_pretrained) rather than a transformers one"
        )
    for layer in cp_layers:
        layer.check_context_parallel(topology.size)
    styles = {
        layer: layer.resolve_attention_cp_style(attention_cp_style, topology.size)
        for layer in cp_layers
        if isinstance(layer, ContextParallelAttention)
    }
    for layer in cp_layers:
        layer.cp_topology = topology
    for layer, style in styles.items():
        layer.attention_cp_style = style
    model.cp_topology = topology
    return topology
