"""Parallelism applied to a built cp_models model by small functions, composed by :func:`parallelize_model`:
activation checkpointing, CP wiring (through the checkpoint wrappers), LoRA, torch.compile of the collective-free
parts, then FSDP2.

FSDP2 shards over every rank of the (dp, cp) mesh, not only over dp: CP ranks hold different tokens of the same
row, so their gradients must be summed anyway, and the reduce-scatter does that while each rank keeps 1/(dp x cp)
of the parameters, gradients and optimizer state. The loss of each rank is already divided by the global token
count, so gradients are summed (divide factor 1), not averaged.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from cp_core import CPTopology
from cp_models.activation_checkpointing import decoder_layers
from cp_models.context_parallel import ContextParallelModule

COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parallelize_model(model: nn.Module, cfg, mesh: DeviceMesh) -> nn.Module:
    """``model`` (built on the CPU in its storage dtype: fp32 under FSDP, else ``model.dtype``) made ready to train
    on ``mesh`` (dims "dp" and "cp"): activation checkpointing, CP wiring, LoRA, then on this rank's device
    torch.compile and FSDP2, each as ``cfg`` asks. Returns the model (FSDP2 changes it in place)."""
    if cfg.model.activation_checkpointing:
        apply_checkpointing(model)
    apply_context_parallel(model, mesh, cfg.parallel.attention_cp)
    if cfg.train.lora.enabled:
        from sft_trainer.lora import apply_lora

        lora = cfg.train.lora
        apply_lora(model, lora.targets, lora.rank, lora.alpha, lora.dropout, seed=cfg.train.seed)
    model.to(mesh_device(mesh))
    if cfg.model.compile:
        apply_compile(model)
    if cfg.parallel.fsdp:
        compute = COMPUTE_DTYPES[cfg.model.dtype]
        apply_fsdp(model, mesh, param_dtype=compute if compute != torch.float32 else None)
    return model


def apply_context_parallel(model: nn.Module, mesh: DeviceMesh, attention_cp: str = "ulysses") -> CPTopology:
    """Give every CP-aware layer of ``model`` the mesh's "cp" group (looking through checkpoint wrappers)."""
    from cp_models import set_context_parallel_attributes

    topology = CPTopology.from_mesh(mesh, "cp")
    set_context_parallel_attributes(model, topology, attention_cp_style=attention_cp)
    return topology


def apply_checkpointing(model: nn.Module) -> None:
    """Activation checkpointing of every decoder block, and of every vision block of a vision-language model."""
    from cp_models import apply_activation_checkpointing

    apply_activation_checkpointing(model)
    if hasattr(model, "vision_blocks"):
        apply_activation_checkpointing(model, model.vision_blocks())


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """This rank's device on ``mesh``: the current CUDA device, or the CPU."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


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
    """Whether ``module`` already runs as fused kernels (the norms on CUDA)."""
    weight = getattr(module, "weight", None)
    if not hasattr(module, "fused_on") or not isinstance(weight, torch.Tensor):
        return False
    return module.fused_on(weight)


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
