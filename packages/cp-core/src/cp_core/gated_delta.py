"""Gated delta rule (Gated DeltaNet) over packed documents, with exact context parallelism.

Per value head, with state ``S`` [K, V]:

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,      o_t = scale * S_t^T q_t

``q, k`` [T, Hk, K], ``v`` [T, Hv, V], ``g`` (log decay, <= 0) and ``beta`` [T, Hv]; Hv a multiple of Hk (value
head ``j`` reads key head ``j // (Hv / Hk)``). The state restarts at zero at every document start, except that the
first document may start from ``initial_state[0]`` (``initial_state`` is [num_docs, Hv, K, V]).

Three implementations: :func:`naive_recurrent_gated_delta_rule` (per token; the oracle), the chunked torch form
:func:`chunk_gated_delta_rule_torch` (WY representation, document-aligned chunks), and flash-linear-attention's
``chunk_gated_delta_rule`` on CUDA. :func:`gated_delta_rule_cp` makes any of them exact under CP: a pre-pass over
the last local document yields its ``(S_ext, M)`` (M by running the same recurrence on identity state columns),
:func:`cp_core.state_passing.pass_states` chains them down the ranks into the first document's initial state,
and the main pass starts from it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from cp_core.chunking import build_chunk_layout
from cp_core.document_bounds import FLA_CHUNK, DocumentBounds, build_document_bounds
from cp_core.errors import ContextParallelError
from cp_core.numerics import upcast
from cp_core.packing import PackedRowMetadata
from cp_core.recurrent_backends import RecurrentBackend, resolve_recurrent_backend
from cp_core.state_passing import pass_states
from cp_core.topology import CPTopology


@dataclass(frozen=True)
class GatedDecay:
    """GDN's log decay ``g = -exp(A_log) * softplus(a + dt_bias)`` [T, Hv], given by its inputs so that fla computes
    it inside its chunk kernel (``use_gate_in_kernel``: no [T, Hv] fp32 tensor and none of the ~8 elementwise
    launches of forward and backward); the torch paths take :meth:`log_decay`. Accepted wherever ``g`` is."""

    a: torch.Tensor  # [T, Hv], the projection's output
    A_log: torch.Tensor  # [Hv]
    dt_bias: torch.Tensor | None = None  # [Hv]

    @property
    def shape(self) -> torch.Size:
        return self.a.shape

    def __getitem__(self, tokens: slice) -> GatedDecay:
        return GatedDecay(self.a[tokens], self.A_log, self.dt_bias)

    def log_decay(self) -> torch.Tensor:
        """``g`` in at least fp32."""
        a = upcast(self.a)
        if self.dt_bias is not None:
            a = a + self.dt_bias
        return -upcast(self.A_log).exp() * F.softplus(a)


def _log_decay(g: torch.Tensor | GatedDecay) -> torch.Tensor:
    """``g`` as the torch paths take it: the log decay itself."""
    return g.log_decay() if isinstance(g, GatedDecay) else g


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum x^2 + eps)`` over the last dim, in at least fp32 (the normalization of q and k in GDN)."""
    x = upcast(x)
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.size(1) == heads else x.repeat_interleave(heads // x.size(1), dim=1)


def _prepare(q, k, v, g, beta, scale, qk_l2norm):
    hv = v.size(1)
    q, k = _expand_heads(q, hv), _expand_heads(k, hv)
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    scale = q.size(-1) ** -0.5 if scale is None else scale
    return upcast(q) * scale, upcast(k), upcast(v), upcast(g), upcast(beta)


def _check(q, k, v, g, beta, seq_lens: Sequence[int], initial_state) -> None:
    t = q.size(0)
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.size(0) != t:
        raise ContextParallelError(
            f"expected q, k [T, Hk, K] and v [T, Hv, V]; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if v.size(1) % q.size(1):
        raise ContextParallelError(f"value heads {v.size(1)} must be a multiple of key heads {q.size(1)}")
    if g.shape != (t, v.size(1)) or beta.shape != (t, v.size(1)):
        raise ContextParallelError(
            f"g and beta must be [T, Hv] = {[t, v.size(1)]}, got {tuple(g.shape)} and {tuple(beta.shape)}"
        )
    if sum(seq_lens) != t:
        raise ContextParallelError(f"document lengths sum to {sum(seq_lens)} but there are {t} tokens")
    expected = (len(seq_lens), v.size(1), q.size(2), v.size(2))
    if initial_state is not None and tuple(initial_state.shape) != expected:
        raise ContextParallelError(
            f"initial_state must be [docs, Hv, K, V] = {list(expected)}, got {tuple(initial_state.shape)}"
        )


def naive_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    seq_lens: Sequence[int],
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token reference (fp32). Returns ``(o [T, Hv, V], final_state [docs, Hv, K, V])``."""
    _check(q, k, v, g, beta, seq_lens, initial_state)
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, qk_l2norm)
    outputs, finals, offset = [], [], 0
    for doc, length in enumerate(seq_lens):
        state = q.new_zeros(v.size(1), q.size(2), v.size(2))
        if initial_state is not None:
            state = upcast(initial_state[doc])
        for t in range(offset, offset + length):
            state = g[t].exp()[:, None, None] * state
            predicted = torch.einsum("hk,hkv->hv", k[t], state)
            state = state + k[t][:, :, None] * (beta[t][:, None] * (v[t] - predicted))[:, None, :]
            outputs.append(torch.einsum("hk,hkv->hv", q[t], state))
        finals.append(state)
        offset += length
    return torch.stack(outputs).to(out_dtype), torch.stack(finals)


def chunk_gated_delta_rule_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    seq_lens: Sequence[int],
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    qk_l2norm: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (WY) torch implementation, fp32 inside. Returns ``(o [T, Hv, V], final_state [docs, Hv, K, V])``.

    Within a chunk with cumulative log decay ``G`` (so ``gamma_t = exp(G_t)``) and entering state ``S``:
    ``U = T (beta V) - T (beta gamma K) S`` with ``T = (I + A)^-1``, ``A[t, s] = beta_t gamma_t / gamma_s k_t.k_s``
    for s < t; then ``O = (gamma Q) S + (Q K^T * D) U`` and ``S' = gamma_L S + (K gamma_L / gamma)^T U``.
    """
    _check(q, k, v, g, beta, seq_lens, initial_state)
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, qk_l2norm)
    layout = build_chunk_layout(seq_lens, chunk_size)
    qc, kc, vc = (layout.gather(t).transpose(1, 2) for t in (q, k, v))  # [C, H, L, D]
    gc, bc = (layout.gather(t).transpose(1, 2) for t in (g, beta))  # [C, H, L]
    cum = gc.cumsum(-1)
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # gamma_t/gamma_s, s<=t
    strictly_lower = lower.tril(-1)
    a = (bc[..., None] * (kc @ kc.transpose(-1, -2)) * decay).masked_fill(~strictly_lower, 0.0)
    eye = torch.eye(chunk_size, device=q.device, dtype=a.dtype).expand_as(a)
    t_inv = torch.linalg.solve_triangular(a + eye, eye, upper=False)
    gamma = cum.exp()
    w = t_inv @ ((bc * gamma)[..., None] * kc)
    u = t_inv @ (bc[..., None] * vc)
    attn = (qc @ kc.transpose(-1, -2)) * decay
    q_decayed = qc * gamma[..., None]
    k_to_end = kc * (cum[..., -1:] - cum).exp()[..., None]
    gamma_end = gamma[..., -1, None, None]

    heads, dk, dv = v.size(1), q.size(2), v.size(2)
    zero = q.new_zeros(heads, dk, dv)
    state = zero
    outputs, finals = [], []
    for c in range(layout.num_chunks):
        if layout.chunk_starts_doc[c]:
            doc = layout.chunk_doc[c]
            state = upcast(initial_state[doc]) if initial_state is not None else zero
        new_values = u[c] - w[c] @ state
        outputs.append(q_decayed[c] @ state + attn[c] @ new_values)
        state = gamma_end[c] * state + k_to_end[c].transpose(-1, -2) @ new_values
        if c == layout.doc_last_chunk[layout.chunk_doc[c]]:
            finals.append(state)
    o = layout.scatter(torch.stack(outputs).transpose(1, 2))
    return o.to(out_dtype), torch.stack(finals)


def _chunk_gated_delta_rule_fla(q, k, v, g, beta, *, bounds: DocumentBounds, scale, initial_state, qk_l2norm):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    gate = {}
    if isinstance(g, GatedDecay):
        gate = {"use_gate_in_kernel": True, "A_log": g.A_log, "dt_bias": g.dt_bias}
        g = g.a
    else:
        g = g.float()
    o, final = chunk_gated_delta_rule(
        q.unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        g.unsqueeze(0),
        beta.unsqueeze(0),
        scale=scale,
        initial_state=initial_state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=qk_l2norm,
        **gate,
        **bounds.fla_kwargs(),
    )
    return o.squeeze(0), final


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | GatedDecay,
    beta: torch.Tensor,
    *,
    seq_lens: Sequence[int],
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    qk_l2norm: bool = False,
    backend: RecurrentBackend = "auto",
    bounds: DocumentBounds | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule over local documents ``seq_lens`` with the chosen backend (no CP). ``bounds``: their kernel
    boundaries on q's device, when the caller holds them (a layer: its row's
    :class:`~cp_core.document_bounds.RowBounds`). ``g`` may be a :class:`GatedDecay`."""
    _check(q, k, v, g, beta, seq_lens, initial_state)
    if resolve_recurrent_backend(backend, q, "gated_delta") == "fla":
        bounds = bounds if bounds is not None else build_document_bounds(seq_lens, q.device)
        return _chunk_gated_delta_rule_fla(
            q, k, v, g, beta, bounds=bounds, scale=scale, initial_state=initial_state, qk_l2norm=qk_l2norm
        )
    g = _log_decay(g)
    return chunk_gated_delta_rule_torch(
        q, k, v, g, beta, seq_lens=seq_lens, scale=scale, initial_state=initial_state, qk_l2norm=qk_l2norm
    )


# The pre-pass runs in checkpointed segments of this many tokens: it then keeps only its inputs and one carried
# state per segment boundary, and its backward works on one segment at a time. Unsegmented, a middle rank's pre-pass
# (v widened by K identity columns) kept a second set of GDN activations and doubled the chunk-state transients:
# 0.8B at 256k / cp 4 peaked 3.3 GiB above 128k / cp 2. On the fla path its inputs are tensors the main kernel
# keeps as well (see gated_delta_rule_cp), so only g is its own.
PREPASS_SEGMENT_TOKENS = 16384
_FLA_CHUNK = FLA_CHUNK  # fla's and chunk_gated_delta_rule_torch's chunk: segments cut on its grid


def _l2norm_autograd(x: torch.Tensor, backend: str) -> torch.Tensor:
    """The q / k normalization the backend's kernel would apply inside: fla's l2norm (its in-kernel path runs the
    same forward and backward kernels and keeps the same output and rstd), else :func:`l2norm` (fp32)."""
    if backend == "fla":
        from fla.modules.l2norm import l2norm as fla_l2norm

        return fla_l2norm(x)
    return l2norm(x)


def _check_segment_tokens(tokens: int | None) -> None:
    if tokens is not None and (tokens <= 0 or tokens % _FLA_CHUNK):
        raise ContextParallelError(
            f"prepass_segment_tokens must be a positive multiple of {_FLA_CHUNK} (the recurrence's chunk) or None, "
            f"got {tokens}"
        )


def prepass_summary(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | GatedDecay,
    beta: torch.Tensor,
    *,
    with_transition: bool,
    scale: float | None = None,
    qk_l2norm: bool = False,
    backend: RecurrentBackend = "auto",
    segment_tokens: int | None = PREPASS_SEGMENT_TOKENS,
    bounds_for: Callable[[Sequence[int]], DocumentBounds] | None = None,
) -> torch.Tensor:
    """The final state of one document stretch from a zero state, ``[Hv, K, V]`` (at least fp32); with
    ``with_transition`` also its transition ``M``: ``[Hv, K, V + K]`` = ``[S_ext | M]``, from the same recurrence
    run on K extra value columns of zeros that start from the identity.

    With gradients on and ``segment_tokens`` set, runs in activation-checkpointed segments of that many tokens,
    carrying the state: it keeps one state per segment for backward instead of its activations, for one more
    forward of itself. ``bounds_for`` gives a segment's kernel boundaries (a row's
    :meth:`~cp_core.document_bounds.RowBounds.for_lens`, built once per row); without it they are built per call.
    """
    _check_segment_tokens(segment_tokens)
    heads, dk, dv = v.size(1), q.size(2), v.size(2)
    state = None
    if with_transition:
        eye = torch.eye(dk, device=q.device, dtype=torch.promote_types(v.dtype, torch.float32))
        state = torch.cat([eye.new_zeros(heads, dk, dv), eye.expand(heads, dk, dk)], dim=-1)

    def segment(state, q_s, k_s, v_s, g_s, beta_s):
        if with_transition:
            v_s = torch.cat([v_s, v_s.new_zeros(v_s.size(0), heads, dk)], dim=-1)
        initial = None if state is None else state[None]
        lens = (v_s.size(0),)
        _, final = gated_delta_rule(
            q_s, k_s, v_s, g_s, beta_s, seq_lens=lens, scale=scale, initial_state=initial, qk_l2norm=qk_l2norm,
            backend=backend, bounds=bounds_for(lens) if bounds_for is not None else None,
        )  # fmt: skip
        return final[0]

    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, beta, *_decay_leaves(g)))
    segmented = needs_grad and segment_tokens is not None
    step = segment_tokens if segmented else q.size(0)
    for start in range(0, q.size(0), step):
        pieces = (state, *(t[start : start + step] for t in (q, k, v, g, beta)))
        if segmented:
            state = torch.utils.checkpoint.checkpoint(segment, *pieces, use_reentrant=False, preserve_rng_state=False)
        else:
            state = segment(*pieces)
    return state


def _decay_leaves(g: torch.Tensor | GatedDecay) -> tuple[torch.Tensor, ...]:
    if isinstance(g, GatedDecay):
        return tuple(t for t in (g.a, g.A_log, g.dt_bias) if t is not None)
    return (g,)


def gated_delta_rule_cp(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | GatedDecay,
    beta: torch.Tensor,
    metadata: PackedRowMetadata,
    topology: CPTopology,
    *,
    scale: float | None = None,
    qk_l2norm: bool = False,
    backend: RecurrentBackend = "auto",
    prepass_segment_tokens: int | None = PREPASS_SEGMENT_TOKENS,
) -> torch.Tensor:
    """This rank's output of the gated delta rule over a packed row sharded over ``topology``.

    Inputs are this rank's tokens ([S/cp, ...]); the result equals the matching slice of the unsharded run.
    Communication: at most one ``[Hv, K, V]`` fp32 state to the next rank forward and one gradient back.
    Extra compute: a pre-pass over the last local document when it continues on the next rank (with ``K`` extra
    identity state columns when the state passes through this rank, to get the transition ``M``). With gradients
    on, the pre-pass runs in activation-checkpointed segments of ``prepass_segment_tokens`` (a multiple of 64), so
    it costs one more forward of itself but almost no memory; None runs it in one piece and keeps its activations.
    ``g`` may be a :class:`GatedDecay`: fla then computes the decay in its kernel.
    """
    _check_segment_tokens(prepass_segment_tokens)  # before any collective
    if q.size(0) != metadata.local_len:
        raise ContextParallelError(
            f"inputs hold {q.size(0)} tokens but this shard has {metadata.local_len} (rank {metadata.cp_rank} "
            f"of cp={metadata.cp_size})"
        )
    lens = metadata.local_seq_lens
    _check(q, k, v, g, beta, lens, None)
    backend = resolve_recurrent_backend(backend, q, "gated_delta")
    row = metadata.kernel_bounds(q.device) if backend == "fla" else None  # built once per row, shared by the layers
    bounds = row.local if row is not None else None
    if not topology.enabled:
        return gated_delta_rule(
            q, k, v, g, beta, seq_lens=lens, scale=scale, qk_l2norm=qk_l2norm, backend=backend, bounds=bounds
        )[0]
    # The pre-pass reads q, k and v again after the main pass's kernel has taken its own copies (fla normalizes q
    # and k and copies a non-contiguous v): its checkpoint would keep the originals, in Qwen3.5 views of the whole
    # conv output. On the fla path both passes read the normalized q, k and a contiguous v instead, the very
    # tensors fla's kernel keeps, so the pre-pass keeps nothing of its own but g. The same kernels run; where the
    # pre-pass also contributes to dq / dk, the two contributions now meet before the normalization's backward
    # (a rounding difference). The torch path keeps its own chunked copies either way: v stays as it is.
    if qk_l2norm:
        q, k = _l2norm_autograd(q, backend), _l2norm_autograd(k, backend)
    if backend == "fla":
        v = v.contiguous()
    run = functools.partial(gated_delta_rule, scale=scale, backend=backend)
    heads, dk, dv = v.size(1), q.size(2), v.size(2)
    state_dtype = torch.promote_types(v.dtype, torch.float32)  # what every rank's chain buffers hold
    final_state = q.new_zeros(heads, dk, dv, dtype=state_dtype)  # placeholders where nobody reads them
    transition = q.new_zeros(heads, dk, dk, dtype=state_dtype)
    if metadata.last_doc_continues:
        # Pre-pass over the last document's local stretch, from a zero state, before the chain delivers S0.
        through = metadata.first_doc_starts_before and len(lens) == 1
        tail = slice(metadata.local_len - lens[-1], None)
        summary = prepass_summary(
            q[tail], k[tail], v[tail], g[tail], beta[tail], with_transition=through, scale=scale,
            backend=backend, segment_tokens=prepass_segment_tokens,
            bounds_for=row.for_lens if row is not None else None,
        )  # fmt: skip
        final_state = summary[..., :dv].to(state_dtype)
        if through:
            transition = summary[..., dv:].to(state_dtype)
    first_state = pass_states(final_state, transition, metadata, topology, "matrix", anchor=q)
    initial = torch.cat([first_state[None], first_state.new_zeros(len(lens) - 1, heads, dk, dv)])
    return run(q, k, v, g, beta, seq_lens=lens, initial_state=initial, bounds=bounds)[0]
