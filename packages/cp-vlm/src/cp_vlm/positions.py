"""3-D MRoPE position ids for a packed row of several documents (Qwen3.5-VL).

A packed row concatenates documents; each document is positioned as if it were alone, i.e. exactly as
``transformers``' ``Qwen3_5Model.get_rope_index`` positions a single unpadded sequence:

- positions restart at 0 at the start of every document;
- a text token takes ``(cur, cur, cur)`` and advances ``cur`` by 1;
- an image (a maximal run of ``image_token_id`` placeholders, merged grid ``(t, h // m, w // m)`` with
  ``m = spatial_merge_size``) gives its ``k``-th placeholder ``cur + (t_k, h_k, w_k)`` in ``(t, h, w)`` raster
  order, then ``cur`` advances by ``max(h, w) // m`` (for images, ``t == 1``, this is the largest extent + 1).

Videos are not supported: there is no ``video_grid_thw`` argument, and a row holding ``video_token_id`` placeholders
is refused with a clear error (pass the id; without it they would be taken for text).
Everything is computed on the host with vectorized torch ops (the only Python loops are over images and
documents, for validation messages).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cp_core import ContextParallelError

__all__ = ["packed_mrope_positions"]


def packed_mrope_positions(
    input_ids: torch.Tensor,
    seq_lens: Sequence[int],
    image_grid_thw: torch.Tensor | None,
    *,
    image_token_id: int,
    vision_start_token_id: int,
    spatial_merge_size: int,
    video_token_id: int | None = None,
) -> torch.Tensor:
    """3-D MRoPE position ids ``[3, S]`` (int64) for one packed row ``input_ids`` ``[S]``.

    Args:
        input_ids: token ids of the packed row, shape ``[S]``.
        seq_lens: lengths of the documents packed in the row, in order; they must sum to ``S``.
        image_grid_thw: ``[num_images, 3]`` patch grids ``(t, h, w)`` (before spatial merging) of the images of
            the row, in order of appearance; ``None`` when the row has no image.
        image_token_id: id of the image placeholder token.
        vision_start_token_id: id of the token that must immediately precede every image run (same document).
        spatial_merge_size: the vision tower's spatial merge size ``m``; ``h`` and ``w`` must be multiples of it.
        video_token_id: id of the video placeholder token; a row holding it is refused (videos are unsupported).

    Returns:
        ``[3, S]`` int64 tensor on ``input_ids.device``; rows are the temporal, height and width positions.
        Each document's slice equals ``get_rope_index`` of that document alone.

    Raises:
        ContextParallelError: on inconsistent lengths, image runs vs. grids, run sizes, or runs that cross a
            document boundary or lack their vision-start token.

    Videos are not supported (no ``video_grid_thw`` argument).
    """
    if input_ids.dim() != 1:
        raise ContextParallelError(f"input_ids must be 1-D [S], got shape {tuple(input_ids.shape)}")
    if spatial_merge_size < 1:
        raise ContextParallelError(f"spatial_merge_size must be >= 1, got {spatial_merge_size}")
    m = int(spatial_merge_size)
    device = input_ids.device
    ids = input_ids.detach().to("cpu", torch.long)
    if video_token_id is not None and bool((ids == video_token_id).any()):
        where = int((ids == video_token_id).nonzero()[0])
        raise ContextParallelError(
            f"the row holds video tokens (video_token_id={video_token_id}, first at position {where}); videos are "
            "not supported: use images, or drop the video samples"
        )
    total = ids.numel()

    lens = [int(n) for n in seq_lens]
    if any(n < 0 for n in lens):
        raise ContextParallelError(f"seq_lens must be non-negative, got {lens}")
    if sum(lens) != total:
        raise ContextParallelError(f"seq_lens {lens} sum to {sum(lens)}, but input_ids has length S={total}")

    if image_grid_thw is None:
        grids = torch.zeros(0, 3, dtype=torch.long)
    else:
        grids = image_grid_thw.detach().to("cpu", torch.long)
        if grids.dim() != 2 or grids.shape[1] != 3:
            raise ContextParallelError(f"image_grid_thw must have shape [num_images, 3], got {tuple(grids.shape)}")
        if (grids < 1).any():
            raise ContextParallelError(f"image_grid_thw entries must be >= 1, got {grids.tolist()}")
        bad = ((grids[:, 1] % m) != 0) | ((grids[:, 2] % m) != 0)
        if bad.any():
            i = int(bad.nonzero()[0])
            raise ContextParallelError(
                f"image {i}: grid (t, h, w)={tuple(grids[i].tolist())} has h or w not divisible by "
                f"spatial_merge_size={m}"
            )

    lens_t = torch.tensor(lens, dtype=torch.long)
    doc_starts = torch.cumsum(lens_t, 0) - lens_t  # [D]
    doc_of = torch.repeat_interleave(torch.arange(len(lens)), lens_t)  # [S]

    # Maximal runs of image placeholders (ignoring document boundaries, checked below).
    is_img = ids == image_token_id
    padded = torch.cat([torch.zeros(1, dtype=torch.long), is_img.long(), torch.zeros(1, dtype=torch.long)])
    edges = padded[1:] - padded[:-1]
    run_starts = (edges == 1).nonzero().flatten()  # [R]
    run_ends = (edges == -1).nonzero().flatten()  # [R], exclusive
    run_lens = run_ends - run_starts

    if run_starts.numel():
        crosses = doc_of[run_starts] != doc_of[run_ends - 1]
        if crosses.any():
            r = int(crosses.nonzero()[0])
            s, e = int(run_starts[r]), int(run_ends[r])
            raise ContextParallelError(
                f"image run {r} (tokens [{s}, {e})) crosses a document boundary: it starts in document "
                f"{int(doc_of[s])} and ends in document {int(doc_of[e - 1])} (seq_lens={lens})"
            )

    num_runs, num_grids = run_starts.numel(), grids.shape[0]
    if num_runs != num_grids:
        raise ContextParallelError(
            f"found {num_runs} image-token runs (image_token_id={image_token_id}) but image_grid_thw has "
            f"{num_grids} grids"
        )

    if num_runs:
        gt, gh, gw = grids[:, 0], grids[:, 1] // m, grids[:, 2] // m
        expected = gt * gh * gw
        wrong = run_lens != expected
        if wrong.any():
            r = int(wrong.nonzero()[0])
            raise ContextParallelError(
                f"image run {r} (tokens [{int(run_starts[r])}, {int(run_ends[r])})) has {int(run_lens[r])} tokens "
                f"but its grid (t, h, w)={tuple(grids[r].tolist())} with spatial_merge_size={m} needs "
                f"t*h*w/m^2={int(expected[r])}"
            )
        prev = run_starts - 1
        no_start = (run_starts == doc_starts[doc_of[run_starts]]) | (ids[prev.clamp(min=0)] != vision_start_token_id)
        if no_start.any():
            r = int(no_start.nonzero()[0])
            raise ContextParallelError(
                f"image run {r} (tokens [{int(run_starts[r])}, {int(run_ends[r])})) is not preceded by "
                f"vision_start_token_id={vision_start_token_id} in its document"
            )

    # How much each token advances its document's running position: text 1, image 0 except the last
    # placeholder of a run, which carries the whole image's advance max(h, w) // m.
    inc = (~is_img).long()
    if num_runs:
        inc[run_ends - 1] = torch.maximum(gh, gw)
    before = torch.cumsum(inc, 0) - inc  # exclusive prefix sum over the row
    cur = before - before[doc_starts[doc_of]]  # restart at every document

    pos = cur.unsqueeze(0).repeat(3, 1)
    if num_runs:
        img_idx = is_img.nonzero().flatten()  # placeholders in order, grouped by run
        run_of = torch.repeat_interleave(torch.arange(num_runs), run_lens)
        k = img_idx - run_starts[run_of]
        hh, ww = gh[run_of], gw[run_of]
        base = cur[img_idx]  # equals the run start's position (image tokens advance 0 inside the run)
        pos[0, img_idx] = base + k // (hh * ww)
        pos[1, img_idx] = base + (k // ww) % hh
        pos[2, img_idx] = base + k % ww
    return pos.to(device)
