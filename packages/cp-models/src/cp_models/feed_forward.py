"""Feed-forward pieces that keep less for backward: the MLP output with its activation recomputed, and the
routing-weighted combine of each token's top-k expert outputs."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from cp_core import RecurrentBackend
from cp_models.triton_support import own_kernels_apply


class _WeightedSlotSum(torch.autograd.Function):
    """``out[t] = sum_j weights[t, j] * slots[t, j]`` in the promoted dtype of the two, returned in ``out_dtype``.

    Saves only ``slots`` (in their own dtype) and ``weights``: autograd on ``(slots * weights).sum`` or on an
    ``index_add_`` of weighted outputs keeps a weighted copy too (index_add_ saves its source), and on bf16 slots
    with fp32 weights an fp32 copy of the slots. Deterministic (no atomics), unlike ``index_add_`` on CUDA.
    """

    @staticmethod
    def forward(ctx, slots, weights, out_dtype):
        compute = torch.promote_types(slots.dtype, weights.dtype)
        ctx.save_for_backward(slots, weights)
        return torch.bmm(weights.to(compute)[:, None, :], slots.to(compute)).squeeze(1).to(out_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        slots, weights = ctx.saved_tensors
        compute = torch.promote_types(slots.dtype, weights.dtype)
        grad = grad_out.to(compute)
        grad_slots = torch.bmm(weights.to(compute)[:, :, None], grad[:, None, :]).to(slots.dtype)
        grad_weights = torch.bmm(slots.to(compute), grad[:, :, None]).squeeze(-1).to(weights.dtype)
        return grad_slots, grad_weights, None


def sort_by_expert(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, counts)``: the permutation that sorts the flat [T * k] slots of ``experts`` [T, k] by expert (stable:
    each expert's slots in token order) and each expert's slot count ([num_experts] int64). Counted by a scatter
    rather than ``torch.bincount``, which reads the largest expert id to the host on CUDA."""
    flat = experts.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))
    return flat.argsort(stable=True), counts


def expert_slot_groups(experts: torch.Tensor, num_experts: int):
    """Per expert that received tokens: ``(expert, tokens, slots)``, the tokens in order and their top-k slot, as
    ``torch.where(experts == expert)`` gives them, from one host read of the counts (not one per expert)."""
    order, counts = sort_by_expert(experts, num_experts)
    top_k, start = experts.size(1), 0
    for expert, count in enumerate(counts.tolist()):  # the one host sync of a looped MoE layer
        if count:
            picked = order[start : start + count]
            yield expert, picked // top_k, picked % top_k
            start += count


def combine_expert_outputs(
    sorted_outputs: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """Each token's routing-weighted sum of its top-k expert outputs ([T, D] in ``out_dtype``).

    ``sorted_outputs`` [T * k, D] are the expert outputs in expert-sorted slot order, ``order`` the permutation that
    sorted the flat [T * k] slots (``experts.reshape(-1).argsort()``), ``weights`` [T, k] the routing weights.
    The sum is accumulated in the promoted dtype of outputs and weights (fp32 weights: fp32, as transformers'
    Nemotron-H does). Keeps one [T * k, D] tensor for backward (the outputs back in token order).
    """
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    slots = sorted_outputs[inverse].view(*weights.shape, -1)
    return _WeightedSlotSum.apply(slots, weights, out_dtype)


def _linear_weight_grads(grad_out: torch.Tensor, act: torch.Tensor | None, ctx, weight_index: int):
    """``down_proj``'s weight and bias gradients from its output gradient and (recomputed) input ``act`` (None
    where the weight needs no gradient)."""
    flat_grad = grad_out.reshape(-1, grad_out.size(-1))
    grad_weight = flat_grad.t().mm(act.reshape(-1, act.size(-1))) if ctx.needs_input_grad[weight_index] else None
    grad_bias = flat_grad.sum(0) if ctx.needs_input_grad[weight_index + 1] else None
    return grad_weight, grad_bias


def _swiglu(gate: torch.Tensor, up: torch.Tensor, fused: bool) -> torch.Tensor:
    """``silu(gate) * up``: one Triton pass (fp32 inside, one rounding) or the torch expression."""
    if fused:
        from cp_models.swiglu_triton import swiglu_fwd

        return swiglu_fwd(gate, up)
    return F.silu(gate) * up


class _SwiGLULinear(torch.autograd.Function):
    """``F.linear(silu(gate) * up, weight, bias)`` keeping only ``gate`` and ``up`` for backward.

    Autograd on the plain expression keeps four [T, intermediate] tensors (gate, silu(gate), up, the product);
    silu(gate) and the product are recomputed here. With ``fused`` (CUDA) the product and the two input gradients
    are one Triton kernel each (:mod:`cp_models.swiglu_triton`); otherwise the backward runs the ops autograd would
    (mul, silu_backward, the two matmuls), so the gradients are autograd's. Either way its extra live tensors peak
    at three [T, intermediate] buffers.
    """

    @staticmethod
    def forward(ctx, gate, up, weight, bias, fused):
        ctx.fused = fused
        ctx.save_for_backward(gate, up, weight)
        return F.linear(_swiglu(gate, up, fused), weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        gate, up, weight = ctx.saved_tensors
        if ctx.fused:
            from cp_models.swiglu_triton import swiglu_bwd

            act = _swiglu(gate, up, True) if ctx.needs_input_grad[2] else None
            grad_weight, grad_bias = _linear_weight_grads(grad_out, act, ctx, 2)
            del act
            grad_gate, grad_up = swiglu_bwd(gate, up, grad_out.matmul(weight))
            return grad_gate, grad_up, grad_weight, grad_bias, None
        silu = F.silu(gate)
        grad_weight, grad_bias = _linear_weight_grads(grad_out, silu * up, ctx, 2)
        grad_act = grad_out.matmul(weight)
        grad_up = grad_act * silu if ctx.needs_input_grad[1] else None
        del silu
        grad_gate = torch.ops.aten.silu_backward(grad_act.mul_(up), gate) if ctx.needs_input_grad[0] else None
        return grad_gate, grad_up, grad_weight, grad_bias, None


class _SquaredReLULinear(torch.autograd.Function):
    """``F.linear(relu(x)^2, weight, bias)`` keeping only ``x`` (autograd keeps relu(x) and its square)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return F.linear(F.relu(x).square(), weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        relu = F.relu(x)
        grad_weight, grad_bias = _linear_weight_grads(grad_out, relu.square(), ctx, 1)
        grad_x = None
        if ctx.needs_input_grad[0]:  # pow's backward (grad * 2 relu), then relu's (zero where relu(x) <= 0)
            grad_x = torch.ops.aten.threshold_backward(grad_out.matmul(weight).mul_(relu * 2), relu, 0)
        return grad_x, grad_weight, grad_bias


def _recompute_applies(x: torch.Tensor, module: nn.Module) -> bool:
    """Whether the recomputing Functions apply: autograd is recording; ``module`` is a bare ``nn.Linear`` (not a
    LoRA wrapper or any subclass whose forward does more) without forward hooks of its own (the Functions read its
    weight and never call it; global hooks, which observers such as module trackers register, do not switch the
    path, so what they observe is what runs without them); autocast is off (its casts live in the graph of the
    plain expression, and the Functions' backward would meet the uncast weight)."""
    if not torch.is_grad_enabled() or type(module) is not nn.Linear:
        return False
    if module._forward_hooks or module._forward_pre_hooks:
        return False
    return x.device.type == "meta" or not torch.is_autocast_enabled(x.device.type)


def swiglu_linear(
    gate: torch.Tensor, up: torch.Tensor, down_proj: nn.Module, backend: RecurrentBackend = "auto"
) -> torch.Tensor:
    """``down_proj(silu(gate) * up)``, recomputing silu(gate) and the product in backward: 2 instead of 4
    [T, intermediate] tensors kept; on CUDA (any ``backend`` but "torch") the activation and its gradients are
    one Triton kernel each. Any ``down_proj`` other than a plain ``nn.Linear`` (a LoRA adapter), and
    autocast, get the plain expression."""
    if _recompute_applies(gate, down_proj):
        fused = own_kernels_apply(backend, gate)
        return _SwiGLULinear.apply(gate, up, down_proj.weight, down_proj.bias, fused)
    return down_proj(F.silu(gate) * up)


def squared_relu_linear(x: torch.Tensor, down_proj: nn.Module) -> torch.Tensor:
    """``down_proj(relu(x)^2)``, recomputing relu(x)^2 in backward: 1 instead of 2 [T, intermediate] tensors
    kept. A ``down_proj`` other than a plain ``nn.Linear``, and autocast, get the plain expression."""
    if _recompute_applies(x, down_proj):
        return _SquaredReLULinear.apply(x, down_proj.weight, down_proj.bias)
    return down_proj(F.relu(x).square())
