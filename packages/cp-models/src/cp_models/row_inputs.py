"""The checks every model runs on one packed row before its first collective, and the per-row pieces built from
them: the row's metadata, this rank's embeddings and positions."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
import torch.nn as nn

from cp_core import (
    ContextParallelError,
    CPTopology,
    PackedRowMetadata,
    build_packed_metadata,
    check_same_row_on_every_rank,
)
from cp_core.packing import check_divisible, normalize_seq_lens


def build_row_metadata(
    seq_lens: Sequence[int] | torch.Tensor,
    local_len: int,
    topology: CPTopology,
    device: torch.device | str = "cpu",
    *,
    inputs: Sequence[torch.Tensor | None] = (),
    problem: BaseException | None = None,
) -> PackedRowMetadata:
    """Metadata of one packed row whose local shard has ``local_len`` tokens, on ``device``. First checks that every
    CP rank got the same row, with ``inputs`` of the same shapes, and that no rank's own input checks failed
    (``problem``, see :func:`validated_row_inputs`): :func:`cp_core.check_same_row_on_every_rank`, one tiny
    all-reduce on ``device``. So the validation after it raises on every rank alike; call it before anything else
    that can raise."""
    lens: tuple[int, ...] = ()
    if problem is None:
        try:
            lens = normalize_seq_lens(seq_lens)
            check_divisible(sum(lens), topology.size)
        except Exception as exc:  # shards of unequal size (the padding advice, not "other shapes"), or no lengths
            problem = exc
    extra = (local_len, *tensor_shapes(*inputs))
    check_same_row_on_every_rank(seq_lens, topology, device, extra=extra, problem=problem)  # raises any problem
    total = local_len * topology.size
    if sum(lens) != total:  # before any divisibility advice: the lengths and the shard disagree
        raise ContextParallelError(
            f"seq_lens sum to {sum(lens)} tokens but this rank holds {local_len} of a row split over "
            f"cp={topology.size} ({total} tokens): pass the global document lengths and this rank's shard"
        )
    return build_packed_metadata(lens, topology.rank, topology.size, total_len=total).to(device)


def tensor_shapes(*tensors: torch.Tensor | None) -> tuple[int, ...]:
    """The shapes of ``tensors`` as one flat tuple of ints (each: its rank, then its sizes; -1 for None), to compare
    across ranks."""
    out: list[int] = []
    for t in tensors:
        if isinstance(t, torch.Tensor):  # dtype and device type by a stable code (str hashes differ per process)
            out.extend((t.dim(), *t.shape, zlib.crc32(f"{t.dtype} {t.device.type}".encode())))
        else:
            out.append(-1)
    return tuple(out)


def check_token_values(input_ids: torch.Tensor | None, labels: torch.Tensor | None, vocab_size: int | None) -> None:
    """Integer ``input_ids`` in ``[0, vocab_size)`` and integer ``labels`` below it (negative: ignored), read with
    one host sync; raises :class:`ContextParallelError` naming the value."""
    for name, t in (("input_ids", input_ids), ("labels", labels)):
        if t is not None and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
            raise ContextParallelError(f"{name} must hold integer token ids, got dtype {t.dtype}")
    present = [t for t in (input_ids, labels) if t is not None and t.numel()]
    if vocab_size is None or not present:
        return
    bounds = torch.stack([b for t in present for b in (t.min(), t.max())]).tolist()  # one sync
    if input_ids is not None and input_ids.numel():
        low, high = bounds[:2]
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise ContextParallelError(f"input_ids holds token {bad}, outside the vocabulary [0, {vocab_size})")
    if labels is not None and labels.numel() and bounds[-1] >= vocab_size:
        raise ContextParallelError(f"label {bounds[-1]} is outside the vocabulary of {vocab_size}")


def one_row(name: str, x: torch.Tensor, dims: int) -> torch.Tensor:
    """``x`` with a leading batch dimension of 1 dropped ([1, *row] -> [*row]); raises for any other batch size."""
    if x.dim() == dims + 1:
        if x.size(0) != 1:
            raise ContextParallelError(
                f"{name} has batch size {x.size(0)} (shape {tuple(x.shape)}); a packed row is one sequence "
                "(batch 1): pack the documents into one row and pass their lengths as seq_lens"
            )
        return x[0]
    if x.dim() != dims:
        raise ContextParallelError(f"{name} must have {dims} or {dims + 1} (batch 1) dims, got {tuple(x.shape)}")
    return x


def check_row_inputs(
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    vocab_size: int | None = None,
) -> int:
    """This rank's token count, after checking its inputs: exactly one of ``input_ids`` ([T] or [1, T]) and
    ``inputs_embeds`` ([T, H] or [1, T, H]); ``position_ids`` ending in T ([T], [1, T] or MRoPE [3, T]); ``labels``
    [T] or [1, T], below ``vocab_size`` (negative: ignored)."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ContextParallelError("pass exactly one of input_ids and inputs_embeds")
    if input_ids is not None:
        tokens = one_row("input_ids", input_ids, 1).size(0)
    else:
        tokens = one_row("inputs_embeds", inputs_embeds, 2).size(0)
    if position_ids is not None and (
        position_ids.dim() not in (1, 2)
        or position_ids.size(-1) != tokens
        or (position_ids.dim() == 2 and position_ids.size(0) not in (1, 3))
    ):
        raise ContextParallelError(
            f"position_ids {tuple(position_ids.shape)} must be [T], [1, T] or [3, T] with this rank's T = {tokens}"
        )
    if labels is not None:
        labels = one_row("labels", labels, 1)
        if labels.size(0) != tokens:
            raise ContextParallelError(f"labels {tuple(labels.shape)} must have this rank's {tokens} tokens")
    check_token_values(input_ids, labels, vocab_size)
    return tokens


def validated_row_inputs(*inputs: torch.Tensor | None, vocab_size: int | None = None) -> tuple[int, Exception | None]:
    """:func:`check_row_inputs` without raising: (tokens, None), or (0, what it raised) for
    :func:`build_row_metadata` to raise on every rank alike."""
    try:
        return check_row_inputs(*inputs, vocab_size=vocab_size), None
    except Exception as exc:  # anything a rank's own inputs cause (also a wrong type) must stop every rank
        return 0, exc


def embed_row(
    embed_tokens: nn.Embedding, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None
) -> torch.Tensor:
    """This rank's embeddings [T, H] from ``input_ids`` ([T] or [1, T]) or ``inputs_embeds`` ([T, H] or [1, T, H])
    (checked by :func:`check_row_inputs`)."""
    if input_ids is None:
        return one_row("inputs_embeds", inputs_embeds, 2)
    return embed_tokens(one_row("input_ids", input_ids, 1))


def row_position_ids(position_ids: torch.Tensor | None, meta: PackedRowMetadata) -> torch.Tensor:
    """``position_ids`` as [T] or [3, T] (a [1, T] batch dimension dropped), or the row's own positions when None."""
    if position_ids is None:
        return meta.local_position_ids
    return position_ids[0] if position_ids.dim() == 2 and position_ids.size(0) == 1 else position_ids
