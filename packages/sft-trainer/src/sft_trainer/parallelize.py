"""Parallelism applied to a plain cp_models model by small functions, in torchtitan's order:
activation checkpointing, torch.compile of the collective-free parts, then FSDP2.

FSDP2 shards over every rank of the (dp, cp) mesh, not only over dp: CP ranks hold different tokens of the same
row, so their gradients must be summed anyway, and the reduce-scatter does that while each rank keeps 1/(dp x cp)
of the parameters, gradients and optimizer state. The loss of each rank is already divided by the global token
count, so gradients are summed (divide factor 1), not averaged.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from cp_core import resolve_recurrent_backend
from cp_models.activation_checkpointing import decoder_layers
from cp_models.context_parallel import ContextParallelModule


def _unwrap(module: nn.Module) -> nn.Module:
    """The module under activation-checkpoint and compile wrappers."""
    while True:
        inner = getattr(module, "_checkpoint_wrapped_module", None) or getattr(module, "_orig_mod", None)
        if inner is None:
            return module
        module = inner


def apply_compile(model: nn.Module) -> int:
    """torch.compile, in place, the parts of every block that issue no collective: its norms, its feed-forward
    (MLP or MoE; Nemotron-H's MLP/MoE ``mixer``) and the output norm of its token mixer, unless they already run
    as fused kernels. Token mixers themselves stay eager: their all-to-alls and
    P2P halos would break or serialize the graph. Returns the number of compiled modules."""

    def visit(module: nn.Module) -> int:
        count = 0
        for name, child in module.named_children():
            if name in COMPILED_CHILDREN and not isinstance(child, ContextParallelModule) and not _fused(child):
                child.compile()
                count += 1
            else:
                count += visit(child)
        return count

    return sum(visit(_unwrap(block)) for block in decoder_layers(model))


def _fused(module: nn.Module) -> bool:
    """Whether ``module`` already runs as a fused flash-linear-attention kernel (the norms on CUDA)."""
    weight = getattr(module, "weight", None)
    if not hasattr(module, "backend") or not isinstance(weight, torch.Tensor):
        return False
    return resolve_recurrent_backend(module.backend, weight) == "fla"


# Children of a decoder block (or of its token mixer) that may be compiled; those that are token mixers
# (ContextParallelModule, e.g. Nemotron-H's Mamba or attention ``mixer``) are skipped and searched instead.
COMPILED_CHILDREN = ("input_layernorm", "post_attention_layernorm", "norm", "mlp", "mixer")


def flat_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """A 1-D mesh over all ranks of ``mesh`` (named ``dp_cp``)."""
    if mesh.ndim == 1:
        return mesh
    return mesh._flatten("_".join(mesh.mesh_dim_names))


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype | None = None) -> nn.Module:
    """FSDP2 over all ranks of ``mesh``: one unit per decoder block, the root for embeddings, final norm and head.

    ``param_dtype`` (e.g. bfloat16) is the compute dtype of the gathered parameters; the sharded master weights
    and the gradient reduction stay in the dtype the model was built in (fp32 for mixed precision).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    shard_mesh = flat_mesh(mesh)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    layers = decoder_layers(model)
    for index, block in enumerate(layers):
        # The last block's parameters are needed again right at the start of backward: keep them gathered.
        fully_shard(block, mesh=shard_mesh, mp_policy=policy, reshard_after_forward=index < len(layers) - 1)
    fully_shard(model, mesh=shard_mesh, mp_policy=policy)
    for module in model.modules():  # both settings are per unit
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
            # A plain SUM: NCCL would otherwise use PreMulSum (by 1.0), which gloo lacks.
            module.set_force_sum_reduction_for_comms(True)
    return model
