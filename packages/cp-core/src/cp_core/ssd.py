"""Mamba-2 SSD (a scalar-decay recurrence) over packed documents, with exact context parallelism.

Per head ``h`` (state [P, N]), heads grouped onto ``G`` groups of B and C (head ``h`` uses group ``h // (H/G)``):

    S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T,      y_t = S_t C_t + D_h x_t

``x`` [T, H, P], ``dt`` [T, H] (already biased, softplus'ed and clamped by the layer), ``A`` [H] (negative),
``B, C`` [T, G, N], ``D`` [H] or None. States restart at every document start; the first document may start from
``initial_state[0]`` ([docs, H, P, N]).

Implementations: :func:`naive_recurrent_ssd` (per token; the oracle), :func:`chunk_ssd_torch` (chunked,
document-aligned chunks) and, on CUDA, flash-linear-attention's ``chunk_simple_gla`` with q = C, k = B, v = dt x,
g = dt A, scale 1, or mamba-ssm's Triton SSD (``mamba_chunk_scan_combined`` with ``seq_idx``). Under CP (:func:`ssd_cp`) the recurrence is linear in the initial state, so one pass from zero
suffices: the last document's final state and total decay go through :func:`cp_core.state_passing.pass_states`, and
the first document's outputs get the exact correction ``exp(sum_{i<=t} a_i) S0 C_t``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from cp_core.chunking import build_chunk_layout
from cp_core.document_bounds import DocumentBounds, build_document_bounds
from cp_core.errors import ContextParallelError
from cp_core.numerics import upcast
from cp_core.packing import PackedRowMetadata
from cp_core.recurrent_backends import RecurrentBackend, resolve_recurrent_backend
from cp_core.state_passing import pass_states
from cp_core.topology import CPTopology


def _check(x, dt, A, B, C, D, seq_lens: Sequence[int], initial_state) -> None:
    if x.dim() != 3 or dt.shape != x.shape[:2] or A.shape != (x.size(1),):
        raise ContextParallelError(
            f"expected x [T, H, P], dt [T, H], A [H]; got {tuple(x.shape)}, {tuple(dt.shape)}, {tuple(A.shape)}"
        )
    if B.dim() != 3 or B.shape != C.shape or B.size(0) != x.size(0) or x.size(1) % B.size(1):
        raise ContextParallelError(
            f"B and C must be [T, G, N] with G dividing the {x.size(1)} heads; got {tuple(B.shape)}, {tuple(C.shape)}"
        )
    if D is not None and D.shape != (x.size(1),):
        raise ContextParallelError(f"D must be [H] = [{x.size(1)}], got {tuple(D.shape)}")
    if sum(seq_lens) != x.size(0):
        raise ContextParallelError(f"document lengths sum to {sum(seq_lens)} but there are {x.size(0)} tokens")
    expected = (len(seq_lens), x.size(1), x.size(2), B.size(2))
    if initial_state is not None and tuple(initial_state.shape) != expected:
        raise ContextParallelError(
            f"initial_state must be [docs, H, P, N] = {list(expected)}, got {tuple(initial_state.shape)}"
        )


def _heads(bc: torch.Tensor, heads: int) -> torch.Tensor:
    return bc.repeat_interleave(heads // bc.size(1), dim=1)


def naive_recurrent_ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    seq_lens: Sequence[int],
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token reference. Returns ``(y [T, H, P], final_state [docs, H, P, N])``."""
    _check(x, dt, A, B, C, D, seq_lens, initial_state)
    out_dtype, heads = x.dtype, x.size(1)
    x, dt, A = upcast(x), upcast(dt), upcast(A)
    B, C = upcast(_heads(B, heads)), upcast(_heads(C, heads))
    outputs, finals, offset = [], [], 0
    for doc, length in enumerate(seq_lens):
        state = x.new_zeros(heads, x.size(2), B.size(2))
        if initial_state is not None:
            state = upcast(initial_state[doc])
        for t in range(offset, offset + length):
            state = (dt[t] * A).exp()[:, None, None] * state + (dt[t][:, None] * x[t])[:, :, None] * B[t][:, None, :]
            outputs.append(torch.einsum("hpn,hn->hp", state, C[t]))
        finals.append(state)
        offset += length
    y = torch.stack(outputs)
    if D is not None:
        y = y + upcast(D)[:, None] * x
    return y.to(out_dtype), torch.stack(finals)


def chunk_ssd_torch(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    seq_lens: Sequence[int],
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked torch SSD (fp32 inside). Returns ``(y [T, H, P], final_state [docs, H, P, N])``."""
    _check(x, dt, A, B, C, D, seq_lens, initial_state)
    out_dtype, heads = x.dtype, x.size(1)
    x, dt = upcast(x), upcast(dt)
    log_decay = dt * upcast(A)
    layout = build_chunk_layout(seq_lens, chunk_size)
    xc = layout.gather(x * dt[..., None]).transpose(1, 2)  # [C, H, L, P]
    bc, cc = (layout.gather(upcast(_heads(t, heads))).transpose(1, 2) for t in (B, C))  # [C, H, L, N]
    cum = layout.gather(log_decay).transpose(1, 2).cumsum(-1)  # [C, H, L]
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    intra = ((cc @ bc.transpose(-1, -2)) * decay) @ xc  # [C, H, L, P]
    c_decayed = cc * cum.exp()[..., None]
    x_to_end = xc * (cum[..., -1:] - cum).exp()[..., None]
    gamma_end = cum[..., -1].exp()[..., None, None]  # [C, H, 1, 1]

    zero = x.new_zeros(heads, x.size(2), B.size(2))
    state = zero
    outputs, finals = [], []
    for c in range(layout.num_chunks):
        if layout.chunk_starts_doc[c]:
            doc = layout.chunk_doc[c]
            state = upcast(initial_state[doc]) if initial_state is not None else zero
        outputs.append(intra[c] + c_decayed[c] @ state.transpose(-1, -2))
        state = gamma_end[c] * state + x_to_end[c].transpose(-1, -2) @ bc[c]
        if c == layout.doc_last_chunk[layout.chunk_doc[c]]:
            finals.append(state)
    y = layout.scatter(torch.stack(outputs).transpose(1, 2))
    if D is not None:
        y = y + upcast(D)[:, None] * x
    return y.to(out_dtype), torch.stack(finals)


def _ssd_fla(x, dt, A, B, C, *, bounds: DocumentBounds, D, initial_state):
    from fla.ops.simple_gla import chunk_simple_gla

    heads = x.size(1)
    init = initial_state.transpose(-1, -2).contiguous() if initial_state is not None else None  # fla: [K=N, V=P]
    y, final = chunk_simple_gla(
        _heads(C, heads).unsqueeze(0),
        _heads(B, heads).unsqueeze(0),
        (x * dt[..., None].to(x.dtype)).unsqueeze(0),
        g=(dt.float() * A.float()).unsqueeze(0),
        scale=1.0,
        initial_state=init,
        output_final_state=True,
        # chunk_simple_gla builds its chunk indices itself, through a cache keyed on these tensors' identity: the
        # row's bounds, the same objects in every layer, make that once per row.
        **bounds.fla_kwargs(chunk_indices=False),
    )
    y = y.squeeze(0)
    if D is not None:
        y = y + (D[:, None] * x).to(y.dtype)
    return y, final.transpose(-1, -2)


MAMBA_CHUNK = 256  # mamba-ssm's chunk length for Mamba-2 (its Mamba2 module's default)


def _group_outer(v: torch.Tensor, bc: torch.Tensor) -> torch.Tensor:
    """sum_t v[t, h, :] outer bc[t, group(h), :] -> [H, P, N] (per group: one matmul over the group's heads)."""
    steps, heads, head_dim = v.shape
    groups = bc.size(1)
    per_group = v.reshape(steps, groups, heads // groups * head_dim)
    return torch.einsum("tgm,tgn->gmn", per_group, bc).reshape(heads, head_dim, -1)


def _with_initial_states(y, finals, log_decay, C, seq_lens, initial_state):
    """Adds each document's initial state, exactly: the recurrence is linear in it, so S_t gains
    exp(sum_{i<=t} a_i) S0 and y_t gains that times S0 C_t."""
    heads, head_dim = y.size(1), y.size(2)
    groups = C.size(1)
    pieces, new_finals, offset = [], [], 0
    for doc, length in enumerate(seq_lens):
        span = slice(offset, offset + length)
        decay = log_decay[span].cumsum(0).exp()  # [L, H]
        state = upcast(initial_state[doc]).reshape(groups, heads // groups * head_dim, -1)
        gain = torch.einsum("gmn,tgn->tgm", state, upcast(C[span])).reshape(-1, heads, head_dim)
        pieces.append(y[span] + (decay[..., None] * gain).to(y.dtype))
        new_finals.append(finals[doc] + decay[-1][:, None, None] * upcast(initial_state[doc]))
        offset += length
    return torch.cat(pieces), torch.stack(new_finals)


def _ssd_mamba(x, dt, A, B, C, *, bounds: DocumentBounds, D, initial_state, all_finals: bool = True):
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    # From zero state: the kernel's final state (with gradient) is the last document's; mamba-ssm's per-document
    # states have no backward, so the earlier documents' finals come from their closed form (a few kernels per
    # document, skipped when only the last final is asked for).
    y, last = mamba_chunk_scan_combined(
        x[None],
        dt[None],
        A.float(),
        B[None],
        C[None],
        chunk_size=MAMBA_CHUNK,
        D=D.float() if D is not None else None,
        seq_idx=bounds.seq_idx,
        return_final_states=True,
    )
    y = y[0]
    log_decay = upcast(dt) * upcast(A)
    seq_lens = bounds.seq_lens
    earlier = seq_lens[:-1] if all_finals or initial_state is not None else ()
    finals, offset = [], 0
    for length in earlier:
        span = slice(offset, offset + length)
        cum = log_decay[span].cumsum(0)
        weight = (cum[-1] - cum).exp() * upcast(dt[span])  # [L, H]: decay to the document's end, times dt
        finals.append(_group_outer(weight[..., None] * upcast(x[span]), upcast(B[span])))
        offset += length
    finals = torch.stack([*finals, last[0].float()])
    if initial_state is not None:
        y, finals = _with_initial_states(y, finals, log_decay, C, seq_lens, initial_state)
    return y, finals


def ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    seq_lens: Sequence[int],
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    backend: RecurrentBackend = "auto",
    bounds: DocumentBounds | None = None,
    final_states: Literal["all", "last"] = "all",
) -> tuple[torch.Tensor, torch.Tensor]:
    """SSD over local documents with the chosen backend (no CP). ``bounds``: their kernel boundaries on x's device,
    when the caller holds them (a layer: its row's :class:`~cp_core.document_bounds.RowBounds`).
    ``final_states="last"`` returns only the last document's final state (``[1, H, P, N]``), which spares the
    mamba-ssm path its per-document closed forms."""
    _check(x, dt, A, B, C, D, seq_lens, initial_state)
    if final_states not in ("all", "last"):
        raise ContextParallelError(f"final_states must be 'all' or 'last', got {final_states!r}")
    kernel = resolve_recurrent_backend(backend, x, "ssd")
    if kernel == "mamba_ssm":
        bounds = bounds if bounds is not None else build_document_bounds(seq_lens, x.device)
        y, finals = _ssd_mamba(
            x, dt, A, B, C, bounds=bounds, D=D, initial_state=initial_state, all_finals=final_states == "all"
        )
    elif kernel == "fla":
        bounds = bounds if bounds is not None else build_document_bounds(seq_lens, x.device)
        y, finals = _ssd_fla(x, dt, A, B, C, bounds=bounds, D=D, initial_state=initial_state)
    else:
        y, finals = chunk_ssd_torch(x, dt, A, B, C, seq_lens=seq_lens, D=D, initial_state=initial_state)
    return y, finals if final_states == "all" else finals[-1:]


def ssd_cp(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    metadata: PackedRowMetadata,
    topology: CPTopology,
    *,
    D: torch.Tensor | None = None,
    backend: RecurrentBackend = "auto",
) -> torch.Tensor:
    """This rank's SSD output over a packed row sharded over ``topology`` (exact vs the unsharded run).

    Communication: one all-gather of ``[H, P, N] + [H]`` fp32 per rank forward, one of ``[H, P, N]`` backward.
    """
    if x.size(0) != metadata.local_len:
        raise ContextParallelError(
            f"inputs hold {x.size(0)} tokens but this shard has {metadata.local_len} (rank {metadata.cp_rank} "
            f"of cp={metadata.cp_size})"
        )
    lens = metadata.local_seq_lens
    kernel = resolve_recurrent_backend(backend, x, "ssd")
    bounds = None if kernel == "torch" else metadata.kernel_bounds(x.device).local  # once per row, every layer
    y, finals = ssd(x, dt, A, B, C, seq_lens=lens, D=D, backend=kernel, bounds=bounds, final_states="last")
    if not topology.enabled:
        return y
    log_decay = upcast(dt) * upcast(A)  # [T, H]
    last = log_decay[metadata.local_len - lens[-1] :]
    transition = last.sum(0).exp()  # total decay of the last document's local stretch, [H]
    first_state = pass_states(finals[-1], transition, metadata, topology, "scalar", anchor=x)  # [H, P, N]
    # Exact correction of the first document: S_t gains exp(sum_{i<=t} a_i) S0, so y_t gains that times S0 C_t.
    first = slice(0, lens[0])
    decay = log_decay[first].cumsum(0).exp()  # [T0, H]
    # Per group, not per head: C stays [T0, G, N] (H/G times smaller than expanded to heads, in fp32), and the
    # group's heads are one matmul's columns (head h = g (H/G) + j, as in _heads).
    heads, groups, head_dim = x.size(1), C.size(1), x.size(2)
    state = first_state.reshape(groups, heads // groups * head_dim, -1)  # [G, (H/G) P, N]
    correction = torch.einsum("gmn,tgn->tgm", state, upcast(C[first])).reshape(-1, heads, head_dim)
    correction = decay[..., None] * correction
    return torch.cat([y[first] + correction.to(y.dtype), y[lens[0] :]])
