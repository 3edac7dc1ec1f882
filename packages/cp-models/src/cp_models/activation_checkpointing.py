"""Activation checkpointing of a model's decoder blocks."""

from __future__ import annotations

import torch.nn as nn


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of decoder blocks: ``model.decoder_layers()`` for cp_models' models (the VL model's are its
    language model's), else ``model.model.layers``."""
    layers = (
        model.decoder_layers()
        if hasattr(model, "decoder_layers")
        else getattr(getattr(model, "model", None), "layers", None)
    )
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no ModuleList of decoder blocks (model.decoder_layers())")
    return layers


def apply_activation_checkpointing(model: nn.Module, layers: nn.ModuleList | None = None) -> nn.Module:
    """Wrap every decoder layer in torch's non-reentrant checkpoint wrapper (activations recomputed in backward).

    Works before or after :func:`set_context_parallel_attributes`: CP wiring looks through the wrappers.
    Collectives inside a layer are re-issued during recomputation, identically on every rank.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    layers = layers if layers is not None else decoder_layers(model)
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    return model
