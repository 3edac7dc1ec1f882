"""Varlen causal attention over packed documents, behind one function with interchangeable backends.

Layout is the flash-attn varlen layout: ``q`` [T, Hq, D], ``k``/``v`` [T, Hkv, D] with Hq a multiple of Hkv
(grouped-query attention: query head ``i`` reads KV head ``i // (Hq // Hkv)``), documents delimited by
``cu_seqlens`` [N + 1] (int32). Every token attends causally to earlier tokens of its own document only.

Backends:

- ``"torch"``: the reference: scaled-dot-product attention per document; any device and dtype, exact in
  fp32. The oracle for every other backend.
- ``"varlen"``: ``torch.nn.attention.varlen.varlen_attn`` (CUDA, fp16/bf16).
- ``"flash_attn"``: ``flash_attn.flash_attn_varlen_func`` when flash-attn is installed (CUDA, fp16/bf16).
- ``"auto"``: flash-attn, else torch varlen, on CUDA half-precision tensors; the reference otherwise.

``sliding_window=W`` follows transformers: each token sees itself and the ``W - 1`` tokens before it.
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
from functools import cache
from typing import Literal

import torch
import torch.nn.functional as F

from cp_core.errors import ContextParallelError

AttentionBackend = Literal["auto", "torch", "varlen", "flash_attn"]
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "torch", "varlen", "flash_attn")
_HALF = (torch.float16, torch.bfloat16)


@cache
def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


@cache
def _varlen_attn_signature() -> inspect.Signature | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return inspect.signature(varlen_attn)


def varlen_attn_available() -> bool:
    return _varlen_attn_signature() is not None


def resolve_attention_backend(backend: str, q: torch.Tensor) -> str:
    """The concrete backend for ``q``; raises when a forced backend cannot run these tensors."""
    if backend not in ATTENTION_BACKENDS:
        raise ContextParallelError(f"unknown attention backend {backend!r}; choose one of {ATTENTION_BACKENDS}")
    fast_ok = q.is_cuda and q.dtype in _HALF
    if backend == "auto":
        if fast_ok and flash_attn_available():
            return "flash_attn"
        if fast_ok and varlen_attn_available():
            return "varlen"
        return "torch"
    if backend != "torch" and not fast_ok:
        raise ContextParallelError(
            f"attention backend {backend!r} needs CUDA fp16/bf16 tensors, got {q.dtype} on {q.device}; "
            "use backend='torch' (or 'auto') for other inputs"
        )
    if backend == "flash_attn" and not flash_attn_available():
        raise ContextParallelError("attention backend 'flash_attn' requested but flash-attn is not installed")
    if backend == "varlen" and not varlen_attn_available():
        raise ContextParallelError(
            f"attention backend 'varlen' needs torch.nn.attention.varlen (torch {torch.__version__} lacks it)"
        )
    return backend


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ContextParallelError(
            f"q, k, v must be [tokens, heads, head_dim]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.size(0) == k.size(0) == v.size(0)) or k.size(1) != v.size(1) or q.size(2) != k.size(2):
        raise ContextParallelError(
            f"mismatched q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: tokens must agree, k and v "
            "must have the same heads, q and k the same head dim"
        )
    if q.size(1) % k.size(1):
        raise ContextParallelError(f"query heads {q.size(1)} must be a multiple of key/value heads {k.size(1)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ContextParallelError(f"cu_seqlens must be 1-D with at least 2 entries, got {tuple(cu_seqlens.shape)}")


def _window_mask(length: int, sliding_window: int, device: torch.device) -> torch.Tensor:
    i = torch.arange(length, device=device)
    distance = i[:, None] - i[None, :]
    return (distance >= 0) & (distance < sliding_window)


def torch_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Reference: causal SDPA on each document separately (reads ``cu_seqlens`` on the host)."""
    bounds = cu_seqlens.tolist()
    outputs = []
    for start, end in itertools.pairwise(bounds):
        qd, kd, vd = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        if sliding_window is not None and sliding_window < end - start:
            mask = _window_mask(end - start, sliding_window, q.device)
            out = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True)
        outputs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outputs, dim=0)


def _torch_varlen_kernel(q, k, v, cu_seqlens, max_seqlen, scale, sliding_window):
    from torch.nn.attention.varlen import varlen_attn

    signature = _varlen_attn_signature()
    extra = {}
    if q.size(1) != k.size(1):
        if signature is not None and "enable_gqa" in signature.parameters:
            extra["enable_gqa"] = True
        else:  # older torch: materialize the KV groups
            group = q.size(1) // k.size(1)
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    window = (-1, 0) if sliding_window is None else (sliding_window - 1, 0)
    return varlen_attn(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale, window_size=window, **extra
    )


def _flash_attn_kernel(q, k, v, cu_seqlens, max_seqlen, scale, sliding_window):
    from flash_attn import flash_attn_varlen_func

    window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        softmax_scale=scale,
        causal=True,
        window_size=window,
    )


def varlen_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    backend: AttentionBackend = "auto",
) -> torch.Tensor:
    """Causal attention within each document of a packed sequence; returns [T, Hq, Dv]."""
    _check_inputs(q, k, v, cu_seqlens)
    if sliding_window is not None and sliding_window < 1:
        raise ContextParallelError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    chosen = resolve_attention_backend(backend, q)
    if chosen == "torch":
        return torch_varlen_attention(q, k, v, cu_seqlens, scale=scale, sliding_window=sliding_window)
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32, non_blocking=True)
    kernel = _flash_attn_kernel if chosen == "flash_attn" else _torch_varlen_kernel
    return kernel(q, k, v, cu, max_seqlen, scale, sliding_window)
