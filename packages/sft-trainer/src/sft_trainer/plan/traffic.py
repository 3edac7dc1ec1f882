"""Bytes each rank sends per layer and row: exact closed forms of cp_core's collectives."""

from __future__ import annotations


def ulysses_attention_bytes(
    seq_len: int, cp: int, q_heads: int, kv_heads: int, head_dim: int, elem: int = 2, *, recompute: bool = False
) -> int:
    """Bytes one rank sends per Ulysses attention layer and row, forward + backward.

    ``2 (S/cp) (2 Hq + 2 max(Hkv, cp)) D elem (cp-1)/cp``: forward q, k, v (KV heads replicated up to cp) go to
    head layout in one all-to-all and the output comes back; backward the same in reverse. ``recompute``: activation
    checkpointing re-runs the forward (half of it) in backward.
    """
    if cp == 1:
        return 0
    total = 2 * (seq_len // cp) * (2 * q_heads + 2 * max(kv_heads, cp)) * head_dim * elem * (cp - 1) // cp
    return total + (total // 2 if recompute else 0)


def kv_gather_attention_bytes(
    seq_len: int,
    cp: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    elem: int = 2,
    *,
    recompute: bool = False,
    balance: bool = True,
    v_head_dim: int | None = None,
) -> int:
    """Bytes one rank sends per all-gather-KV attention layer and row, forward + backward, for one document spanning
    the row (the busiest case).

    ``2 (cp-1) (S/cp) 2 Hkv D elem``: forward the shard's k|v to every other rank (all-gather); backward the row's
    k|v gradients reduce-scattered, ``(cp-1)/cp`` of ``S 2 Hkv D``. ``balance`` (cp_core's default): rank pairs swap
    the second halves of their shards' queries and, back, their outputs; backward the output gradients and the
    query gradients: ``2 (S/cp - S/cp // 2) Hq (D + Dv) elem`` (``Dv``: ``v_head_dim``, default ``head_dim``;
    every rank but the middle one of an odd cp, which keeps its queries). ``k`` and ``v`` of different head dims
    are gathered apart, the same bytes when ``Dv = D``. ``recompute``: activation checkpointing re-runs the forward (half of it) in backward.
    """
    if cp == 1:
        return 0
    block, swap = _kv_block_and_swap_bytes(seq_len, cp, q_heads, kv_heads, head_dim, elem, balance, v_head_dim)
    total = 2 * (cp - 1) * block + swap
    return total + (total // 2 if recompute else 0)


def _kv_block_and_swap_bytes(seq_len, cp, q_heads, kv_heads, head_dim, elem, balance, v_head_dim) -> tuple[int, int]:
    """A rank's k|v bytes, and what balancing's query swap sends forward + backward (the busiest rank)."""
    local, dv = seq_len // cp, head_dim if v_head_dim is None else v_head_dim
    swap = 2 * (local - local // 2) * q_heads * (head_dim + dv) * elem if balance and local > 1 else 0
    return local * kv_heads * (head_dim + dv) * elem, swap


def kv_ring_attention_bytes(
    seq_len: int,
    cp: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    elem: int = 2,
    *,
    recompute: bool = False,
    balance: bool = True,
    v_head_dim: int | None = None,
) -> int:
    """Bytes one rank sends per ring-attention layer and row, forward + backward, for one document spanning the row
    (``cp - 1`` hops, every rank sending the same).

    With ``B = (S/cp) Hkv (D + Dv) elem``, a rank's k|v block: forward ``(cp-1) B`` (the block it holds, passed on
    each hop); backward ``2 (cp-1) B`` (the block and its gradient each hop) and ``B`` (the gradient back to its
    owner); plus the query swap of ``balance`` as in :func:`kv_gather_attention_bytes`. ``recompute``: activation
    checkpointing re-runs the forward share in backward.
    """
    if cp == 1:
        return 0
    block, swap = _kv_block_and_swap_bytes(seq_len, cp, q_heads, kv_heads, head_dim, elem, balance, v_head_dim)
    forward = (cp - 1) * block + swap // 2
    backward = 2 * (cp - 1) * block + block + swap // 2
    return forward + backward + (forward if recompute else 0)


def _state_passing_bytes(halo_channels: int, conv_width: int, state_elems: int, cp: int, elem: int, recompute: bool):
    """Conv halo (W-1 rows in the activation dtype) + one fp32 state, each way, for the busiest rank.

    Forward: a rank sends its last W-1 conv inputs and its outgoing state to the next rank; backward: the halo's
    and the state's gradients to the previous one. Interior ranks (cp > 2) do both, the chain ends only one (rank 0
    the forward sends, the last rank the backward ones)."""
    if cp == 1:
        return 0
    one_way = (conv_width - 1) * halo_channels * elem + 4 * state_elems
    if cp == 2:  # rank 0: forward only (sent again by recomputation); the last rank: backward only
        return one_way * (2 if recompute else 1)
    return one_way * (3 if recompute else 2)


def gdn_bytes(config, seq_len: int, cp: int, elem: int = 2, *, recompute: bool = False) -> int:
    """Bytes the busiest rank sends per Gated DeltaNet layer and row (forward + backward), one document spanning
    the row: ``causal_conv1d_cp``'s halo of ``W-1`` rows of q|k|v (``2 Hk K + Hv V`` channels, ``elem`` bytes) and
    ``gated_delta_rule_cp``'s fp32 state ``[Hv, K, V]``, to the next rank forward and back in backward (both on
    interior ranks, one at cp = 2). Independent of ``seq_len``."""
    k_heads, v_heads = config.linear_num_key_heads, config.linear_num_value_heads
    k_dim, v_dim = config.linear_key_head_dim, config.linear_value_head_dim
    channels = 2 * k_heads * k_dim + v_heads * v_dim
    return _state_passing_bytes(channels, config.linear_conv_kernel_dim, v_heads * k_dim * v_dim, cp, elem, recompute)


def mamba_bytes(config, style: str, seq_len: int, cp: int, elem: int = 2, *, recompute: bool = False) -> int:
    """Bytes the busiest rank sends per Mamba-2 layer and row (forward + backward), one document spanning the row.

    ``"state_passing"``: ``2 ((W-1)(HP + 2GN) elem + 4 HPN)`` (conv halo + fp32 SSD state, each way; half at cp 2);
    ``"a2a"``: ``2 T (2HP + 2G'N + H) elem (cp-1)/cp`` with ``T = S/cp``, ``G' = max(n_groups, cp)`` (x, B, C, dt to
    heads in one all-to-all, y back; the same backward)."""
    h, p, g, n, w = (
        config.mamba_num_heads,
        config.mamba_head_dim,
        config.n_groups,
        config.ssm_state_size,
        config.conv_kernel,
    )
    if cp == 1:
        return 0
    if style == "a2a":
        total = 2 * (seq_len // cp) * (2 * h * p + 2 * max(g, cp) * n + h) * elem * (cp - 1) // cp
        return total + (total // 2 if recompute else 0)
    if style != "state_passing":
        raise ValueError(f"unknown Mamba CP style {style!r}; choose 'state_passing' or 'a2a'")
    return _state_passing_bytes(h * p + 2 * g * n, w, h * p * n, cp, elem, recompute)
