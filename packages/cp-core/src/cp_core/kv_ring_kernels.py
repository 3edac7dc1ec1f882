"""Ring attention's block kernels: a block of packed query ranges against key ranges with the log-sum-exp, and the
backward of one block given the whole row's output and log-sum-exp.

Layout as flash-attn's varlen: q [Tq, Hq, D], k/v [Tk, Hkv, D], documents by cu_q / cu_k (int32); lse [Hq, Tq].
``causal``: each document's keys are its queries' own positions (equal lengths); otherwise every key precedes every
query of its document (no mask). torch's built-in FlashAttention-2 on CUDA fp16/bf16 tensors; the torch reference
(fp32 or fp64 math; the tests' oracle) elsewhere.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cp_core.errors import ContextParallelError
from cp_core.varlen_attention import _causal_mask, resolve_attention_backend


def _document_scores(q, k, v, cu_q, cu_k, causal: bool, scale: float):
    """Per document of a block: its rows ``(q0, q1)``, its q, k, v in fp32 (fp64 for fp64 inputs; k and v repeated
    to the query heads) and its masked scores ``[H, q, k]``."""
    compute = torch.promote_types(q.dtype, torch.float32)
    group = q.size(1) // k.size(1)
    for (q0, q1), (k0, k1) in zip(_pairs(cu_q), _pairs(cu_k), strict=True):
        qd = q[q0:q1].to(compute)
        kd, vd = (t[k0:k1].to(compute).repeat_interleave(group, dim=1) for t in (k, v))
        scores = torch.einsum("ihd,jhd->hij", qd, kd) * scale
        if causal:
            scores = scores.masked_fill(~_causal_mask(q1 - q0, k1 - k0, None, q.device), float("-inf"))
        yield (q0, q1), qd, kd, vd, scores


def reference_block_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal: bool, scale: float):
    """Torch reference of a block's attention: ``(out, lse)`` in fp32 (fp64 for fp64 inputs)."""
    outputs, lses = [], []
    for _, _, _, vd, scores in _document_scores(q, k, v, cu_q, cu_k, causal, scale):
        lse = scores.logsumexp(-1)
        outputs.append(torch.einsum("hij,jhd->ihd", (scores - lse[..., None]).exp(), vd))
        lses.append(lse)
    return torch.cat(outputs), torch.cat(lses, dim=1)


def reference_block_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal: bool, scale: float):
    """Torch reference of a block's backward: ``(dq, dk, dv)`` of this block's share, from the row's ``out`` and
    ``lse`` (the probabilities are ``exp(scores - lse)``; ``rowsum(dout * out)`` is the softmax's correction)."""
    heads_kv, group = k.size(1), q.size(1) // k.size(1)
    dqs, dks, dvs = [], [], []
    for (q0, q1), qd, kd, vd, scores in _document_scores(q, k, v, cu_q, cu_k, causal, scale):
        do, od = (t[q0:q1].to(qd.dtype) for t in (dout, out))
        probs = (scores - lse[:, q0:q1, None].to(qd.dtype)).exp()
        dvs.append(torch.einsum("hij,ihd->jhd", probs, do))
        dprobs = torch.einsum("ihd,jhd->hij", do, vd)
        correction = (do * od).sum(-1).transpose(0, 1)  # [H, i]
        dscores = probs * (dprobs - correction[..., None])
        dqs.append(torch.einsum("hij,jhd->ihd", dscores, kd) * scale)
        dks.append(torch.einsum("hij,ihd->jhd", dscores, qd) * scale)

    def per_kv_head(t: torch.Tensor) -> torch.Tensor:
        return t.view(t.size(0), heads_kv, group, t.size(2)).sum(2)

    return torch.cat(dqs), per_kv_head(torch.cat(dks)), per_kv_head(torch.cat(dvs))


def _pairs(cu: torch.Tensor) -> list[tuple[int, int]]:
    bounds = cu.tolist()
    return list(itertools.pairwise(bounds))


def flash_block_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal: bool, scale: float):
    """torch's FlashAttention-2 forward: ``(out, lse)``, out in q's dtype, lse fp32 ``[Hq, Tq]``."""
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale
    )
    return out, lse


@functools.cache
def _flash_lse_is_packed(device: torch.device) -> bool:
    """Whether torch's flash kernels return the varlen log-sum-exp as ``[heads, tokens]`` (older flash-attn 2
    releases padded it per document), probed once per device with a two-document call."""
    q = torch.zeros(3, 2, 8, device=device, dtype=torch.bfloat16)
    kv = torch.zeros(3, 1, 8, device=device, dtype=torch.bfloat16)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32, device=device)
    _, lse = flash_block_forward(q, kv, kv, cu, cu, 2, 2, True, 1.0)
    return tuple(lse.shape) == (2, 3)


def flash_block_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal: bool, scale: float):
    """torch's FlashAttention-2 backward of one block, from the row's ``out`` and ``lse``."""
    no_dropout = torch.zeros(2, dtype=torch.uint64, device=q.device)  # the rng state; unread without dropout
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, no_dropout, unused, scale=scale
    )
    return dq, dk, dv


@dataclass(frozen=True)
class BlockKernels:
    forward: Callable
    backward: Callable
    on_host: bool
    """Whether the kernels read the document bounds on the host (the reference) or on q's device."""


REFERENCE_KERNELS = BlockKernels(reference_block_forward, reference_block_backward, on_host=True)
FLASH_KERNELS = BlockKernels(flash_block_forward, flash_block_backward, on_host=False)


def resolve_ring_kernels(backend: str, q: torch.Tensor, v: torch.Tensor) -> BlockKernels:
    """The block kernels for ``backend`` and these tensors; raises when a forced fast backend cannot run them."""
    chosen = resolve_attention_backend(backend, q)
    if chosen == "torch":
        return REFERENCE_KERNELS
    problems = []
    if not torch.backends.cuda.is_flash_attention_available():
        problems.append("this torch build has no flash attention kernels")
    if q.size(-1) != v.size(-1) or q.size(-1) > 256 or q.size(-1) % 8:
        problems.append(f"flash attention needs one head dim <= 256 and a multiple of 8, got q {q.size(-1)}, "
                        f"v {v.size(-1)}")  # fmt: skip
    elif not problems and not _flash_lse_is_packed(q.device):
        problems.append(f"torch {torch.__version__}'s flash kernels pad the log-sum-exp per document")
    if problems:
        raise ContextParallelError(
            f"ring attention cannot use its flash kernels ({'; '.join(problems)}); use attention CP style "
            "'kv_gather', or backend='torch' for the reference"
        )
    return FLASH_KERNELS
