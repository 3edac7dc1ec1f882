"""Packed layouts (document lengths of one row) that stress the cuts between CP shards."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence


def random_seq_lens(total_len: int, rng: random.Random, max_docs: int | None = None) -> list[int]:
    """Random positive document lengths summing to ``total_len`` (between 1 and ``max_docs`` documents)."""
    max_docs = min(total_len, max_docs or total_len)
    num_docs = rng.randint(1, max_docs)
    cuts = sorted(rng.sample(range(1, total_len), num_docs - 1))
    bounds = [0, *cuts, total_len]
    return [b - a for a, b in itertools.pairwise(bounds)]


def _lens_from_bounds(bounds: Sequence[int], total_len: int) -> list[int]:
    points = sorted({0, total_len, *(b for b in bounds if 0 < b < total_len)})
    return [b - a for a, b in itertools.pairwise(points)]


def layout_cases(total_len: int, cp: int, seed: int = 0) -> dict[str, list[int]]:
    """Named packed layouts that stress CP boundaries, for a row of ``total_len`` tokens over ``cp`` ranks.

    - ``single_document``: one document fills the row (it spans every rank).
    - ``cuts_on_boundaries``: every shard boundary is also a document boundary.
    - ``cuts_inside_documents``: random documents, none starting exactly at a shard boundary.
    - ``spans_all_ranks``: a document from inside the first shard to inside the last (middle ranks hold only
      its middle), with short documents around it.
    - ``tiny_documents``: documents of 1 to 3 tokens everywhere.
    - ``mixed_random``: random lengths from a seeded generator.
    """
    if total_len % cp or total_len // cp < 4:
        raise ValueError(f"layout_cases needs total_len divisible by cp with >= 4 tokens a rank, got {total_len}/{cp}")
    rng = random.Random(seed)
    local = total_len // cp
    shard_cuts = [r * local for r in range(1, cp)]
    cases: dict[str, list[int]] = {"single_document": [total_len]}

    inner = list(shard_cuts)
    for r in range(cp):
        inner += [r * local + rng.randint(1, local - 1) for _ in range(rng.randint(0, 2))]
    cases["cuts_on_boundaries"] = _lens_from_bounds(inner, total_len)

    while True:
        lens = random_seq_lens(total_len, rng, max_docs=max(2, total_len // 6))
        bounds = set(_cumulative(lens))
        if not bounds & set(shard_cuts):
            break
    cases["cuts_inside_documents"] = lens

    start, end = rng.randint(1, local - 1), total_len - rng.randint(1, local - 1)
    if end <= start:  # cp == 1: the first and last shard are the same one; keep the document non-empty
        start, end = end, start + 1
    head = [start - 1, 1] if start > 1 else [1]
    cases["spans_all_ranks"] = [*head, end - start, *([1] * (total_len - end))]

    tiny: list[int] = []
    while sum(tiny) < total_len:
        tiny.append(min(rng.randint(1, 3), total_len - sum(tiny)))
    cases["tiny_documents"] = tiny
    cases["mixed_random"] = random_seq_lens(total_len, rng, max_docs=max(1, total_len // 4))
    return cases


def _cumulative(lens: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for x in lens:
        acc += x
        out.append(acc)
    return out
