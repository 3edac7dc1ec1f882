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

Queries and keys may have their own boundaries (``cu_seqlens_k``; all-gather-KV context parallelism): document
``i``'s queries are then the last ``q_len_i`` of its ``k_len_i >= q_len_i`` keys, so the causal diagonal is aligned
at the bottom right (flash-attn's rule): query ``t`` sees keys ``0 .. t + k_len_i - q_len_i``.
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
from cp_core.packing import PackedRowMetadata
from cp_core.topology import CPTopology

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


def _check_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_k: torch.Tensor | None
) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ContextParallelError(
            f"q, k, v must be [tokens, heads, head_dim]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    same_tokens = cu_seqlens_k is not None or q.size(0) == k.size(0)
    if not (same_tokens and k.size(0) == v.size(0)) or k.size(1) != v.size(1) or q.size(2) != k.size(2):
        raise ContextParallelError(
            f"mismatched q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: tokens must agree (k and v "
            "always; q too unless cu_seqlens_k is given), k and v must have the same heads, q and k the same head dim"
        )
    if q.size(1) % k.size(1):
        raise ContextParallelError(f"query heads {q.size(1)} must be a multiple of key/value heads {k.size(1)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ContextParallelError(f"cu_seqlens must be 1-D with at least 2 entries, got {tuple(cu_seqlens.shape)}")
    if cu_seqlens_k is not None and cu_seqlens_k.shape != cu_seqlens.shape:
        raise ContextParallelError(
            f"cu_seqlens_k {tuple(cu_seqlens_k.shape)} must have one entry per entry of cu_seqlens "
            f"{tuple(cu_seqlens.shape)} (the same documents)"
        )


def check_attention_shard(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: PackedRowMetadata, topology: CPTopology
) -> None:
    """Raise unless q, k, v are this rank's shard of the row ``metadata`` describes, for ``topology``."""
    if metadata.cp_size != topology.size or metadata.cp_rank != topology.rank:
        raise ContextParallelError(
            f"metadata was built for rank {metadata.cp_rank} of cp={metadata.cp_size}, but the topology is "
            f"rank {topology.rank} of cp={topology.size}"
        )
    if q.dim() != 3 or q.size(0) != metadata.local_len:
        raise ContextParallelError(
            f"q must be [local tokens={metadata.local_len}, heads, head_dim] for this shard, got {tuple(q.shape)}"
        )
    if k.dim() != 3 or v.dim() != 3 or k.size(0) != q.size(0) or v.size(0) != q.size(0) or k.size(1) != v.size(1):
        raise ContextParallelError(
            f"k and v must be [{q.size(0)} local tokens, kv_heads, head_dim] like q {tuple(q.shape)}; "
            f"got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.size(1) % k.size(1):
        raise ContextParallelError(f"query heads {q.size(1)} must be a multiple of key/value heads {k.size(1)}")


def _causal_mask(q_len: int, k_len: int, sliding_window: int | None, device: torch.device) -> torch.Tensor:
    """[q_len, k_len] mask, the diagonal at the bottom right: query ``t`` is key ``t + k_len - q_len``."""
    distance = torch.arange(q_len, device=device)[:, None] + (k_len - q_len) - torch.arange(k_len, device=device)
    allowed = distance >= 0
    return allowed if sliding_window is None else allowed & (distance < sliding_window)


def torch_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: causal SDPA on each document separately (reads ``cu_seqlens`` on the host)."""
    q_bounds = cu_seqlens.tolist()
    k_bounds = q_bounds if cu_seqlens_k is None else cu_seqlens_k.tolist()
    outputs = []
    for (q_start, q_end), (k_start, k_end) in zip(
        itertools.pairwise(q_bounds), itertools.pairwise(k_bounds), strict=True
    ):
        q_len, k_len = q_end - q_start, k_end - k_start
        if k_len < q_len:
            raise ContextParallelError(
                f"a document has {q_len} queries but {k_len} keys: its queries must be the last of its keys"
            )
        qd = q[q_start:q_end].transpose(0, 1).unsqueeze(0)
        kd, vd = (t[k_start:k_end].transpose(0, 1).unsqueeze(0) for t in (k, v))
        if k_len == q_len and (sliding_window is None or sliding_window >= k_len):
            out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True)
        else:  # SDPA's is_causal aligns the diagonal at the top left, so longer keys need the mask
            mask = _causal_mask(q_len, k_len, sliding_window, q.device)
            out = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale, enable_gqa=True)
        outputs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outputs, dim=0)


def _torch_varlen_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale, sliding_window):
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
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window, **extra)


def _flash_attn_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale, sliding_window):
    from flash_attn import flash_attn_varlen_func

    window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max_q,
        max_k,
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
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
) -> torch.Tensor:
    """Causal attention within each document of a packed sequence; returns [T, Hq, Dv].

    With ``cu_seqlens_k`` (and ``max_seqlen_k``) the keys have their own boundaries, each document's queries being
    the last of its keys (bottom-right causal alignment; see the module docstring)."""
    _check_inputs(q, k, v, cu_seqlens, cu_seqlens_k)
    if sliding_window is not None and sliding_window < 1:
        raise ContextParallelError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if (cu_seqlens_k is None) != (max_seqlen_k is None):
        raise ContextParallelError("cu_seqlens_k and max_seqlen_k go together: pass both or neither")
    chosen = resolve_attention_backend(backend, q)
    if chosen == "torch":
        return torch_varlen_attention(
            q, k, v, cu_seqlens, scale=scale, sliding_window=sliding_window, cu_seqlens_k=cu_seqlens_k
        )
    cu_q = cu_seqlens.to(device=q.device, dtype=torch.int32, non_blocking=True)
    cu_k = cu_q if cu_seqlens_k is None else cu_seqlens_k.to(device=q.device, dtype=torch.int32, non_blocking=True)
    max_k = max_seqlen if max_seqlen_k is None else max_seqlen_k
    kernel = _flash_attn_kernel if chosen == "flash_attn" else _torch_varlen_kernel
    return kernel(q, k, v, cu_q, cu_k, max_seqlen, max_k, scale, sliding_window)
