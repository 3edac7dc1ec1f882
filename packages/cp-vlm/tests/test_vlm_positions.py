"""packed_mrope_positions equals transformers' Qwen3.5 get_rope_index per document, and validates its input."""

import random

import pytest
import torch
from transformers import Qwen3_5Config
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

from cp_core import ContextParallelError
from cp_vlm import packed_mrope_positions

IMG, VIDEO, VSTART, VEND = 90, 91, 88, 89
MERGE = 2


@pytest.fixture(scope="module")
def hf_model():
    config = Qwen3_5Config(
        text_config={
            "vocab_size": 96,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 2,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": 32,
            "spatial_merge_size": MERGE,
            "num_position_embeddings": 16,
        },
        image_token_id=IMG,
        video_token_id=VIDEO,
        vision_start_token_id=VSTART,
        vision_end_token_id=VEND,
    )
    return Qwen3_5Model(config).eval()


def make_doc(rng, segments):
    """segments: ints (text lengths) or (t, h, w) grids. Returns (ids list, grids list)."""
    ids, grids = [], []
    for seg in segments:
        if isinstance(seg, int):
            ids += [rng.randrange(0, 80) for _ in range(seg)]
        else:
            t, h, w = seg
            ids += [VSTART] + [IMG] * (t * h * w // MERGE**2) + [VEND]
            grids.append(list(seg))
    return ids, grids


def reference(model, ids, grids):
    input_ids = torch.tensor([ids])
    mm_token_type_ids = (input_ids == IMG).int()  # what the processor returns: text 0, image 1
    grid = torch.tensor(grids, dtype=torch.long) if grids else None
    with torch.no_grad():
        pos, _ = model.get_rope_index(input_ids, mm_token_type_ids=mm_token_type_ids, image_grid_thw=grid)
    return pos[:, 0, :]


def packed(docs):
    ids = [i for d, _ in docs for i in d]
    grids = [g for _, gs in docs for g in gs]
    grid = torch.tensor(grids, dtype=torch.long) if grids else None
    return torch.tensor(ids), [len(d) for d, _ in docs], grid


def run(ids, seq_lens, grid):
    return packed_mrope_positions(
        ids, seq_lens, grid, image_token_id=IMG, vision_start_token_id=VSTART, spatial_merge_size=MERGE
    )


GRIDS = [(1, 4, 6), (1, 2, 2), (1, 6, 2), (2, 4, 4), (1, 8, 4), (3, 2, 4), (1, 4, 4)]


def check_row(model, docs):
    ids, seq_lens, grid = packed(docs)
    out = run(ids, seq_lens, grid)
    assert out.shape == (3, ids.numel()) and out.dtype == torch.long
    start = 0
    for d, gs in docs:
        ref = reference(model, d, gs)
        got = out[:, start : start + len(d)]
        assert torch.equal(got, ref), (d, gs, got, ref)
        if not gs:
            assert torch.equal(got, torch.arange(len(d)).expand(3, -1))
        start += len(d)


def test_fixed_row_matches_hf(hf_model):
    rng = random.Random(0)
    docs = [
        make_doc(rng, [5, (1, 4, 6), 3]),
        make_doc(rng, [7]),
        make_doc(rng, [2, (1, 6, 2), 4, (2, 4, 4), 1]),
        make_doc(rng, [3, (3, 2, 4), (1, 2, 2), 2]),  # t > max(h, w) / m; two images back to back
        make_doc(rng, [1]),
    ]
    check_row(hf_model, docs)


@pytest.mark.parametrize("seed", range(6))
def test_random_rows_match_hf(hf_model, seed):
    rng = random.Random(seed)
    docs = []
    for _ in range(rng.randint(1, 5)):
        segments = [rng.randint(1, 6)]
        for _ in range(rng.choice([0, 0, 1, 2])):
            segments += [rng.choice(GRIDS), rng.randint(1, 5)]
        docs.append(make_doc(rng, segments))
    check_row(hf_model, docs)


def test_image_at_document_end_and_text_only_row(hf_model):
    rng = random.Random(1)
    check_row(hf_model, [make_doc(rng, [2, (1, 4, 6)]), make_doc(rng, [3, (1, 2, 2)])])
    check_row(hf_model, [make_doc(rng, [4]), make_doc(rng, [6])])
    ids, seq_lens, _ = packed([make_doc(rng, [4]), make_doc(rng, [6])])
    assert torch.equal(run(ids, seq_lens, None), torch.cat([torch.arange(4), torch.arange(6)]).expand(3, -1))


def _ids(*parts):
    return torch.tensor([i for p in parts for i in p])


def test_seq_lens_must_sum_to_length():
    ids = _ids([1, 2, 3, 4])
    with pytest.raises(ContextParallelError, match=r"seq_lens \[2, 1\] sum to 3.*S=4"):
        run(ids, [2, 1], None)


def test_run_count_must_match_grids():
    ids = _ids([1, VSTART], [IMG] * 6, [VEND, 2])
    with pytest.raises(ContextParallelError, match=r"found 1 image-token runs.*has 2 grids"):
        run(ids, [10], torch.tensor([[1, 4, 6], [1, 2, 2]]))
    with pytest.raises(ContextParallelError, match=r"found 1 image-token runs.*has 0 grids"):
        run(ids, [10], None)


def test_run_length_must_match_grid():
    ids = _ids([1, VSTART], [IMG] * 5, [VEND, 2])
    with pytest.raises(ContextParallelError, match=r"has 5 tokens.*\(1, 4, 6\).*t\*h\*w/m\^2=6"):
        run(ids, [9], torch.tensor([[1, 4, 6]]))


def test_run_must_not_cross_document_boundary():
    ids = _ids([1, VSTART], [IMG] * 6, [VEND])
    with pytest.raises(ContextParallelError, match=r"crosses a document boundary.*document 0.*document 1"):
        run(ids, [5, 4], torch.tensor([[1, 4, 6]]))


def test_run_needs_vision_start_and_mergeable_grid():
    ids = _ids([1, 2], [IMG] * 6, [VEND])
    with pytest.raises(ContextParallelError, match=f"not preceded by vision_start_token_id={VSTART}"):
        run(ids, [9], torch.tensor([[1, 4, 6]]))
    ids = _ids([VSTART], [IMG] * 6, [VEND])
    with pytest.raises(ContextParallelError, match="not preceded"):  # vision start belongs to the previous doc
        run(ids, [1, 7], torch.tensor([[1, 4, 6]]))
    with pytest.raises(ContextParallelError, match="not divisible by spatial_merge_size=2"):
        run(_ids([VSTART], [IMG] * 6), [7], torch.tensor([[1, 3, 8]]))


def test_videos_are_refused_clearly():
    ids = torch.tensor([5, 6, VIDEO, VIDEO, 7])
    with pytest.raises(ContextParallelError, match=r"video_token_id=91, first at position 2.*not supported"):
        packed_mrope_positions(
            ids, [5], None, image_token_id=IMG, vision_start_token_id=VSTART, spatial_merge_size=2, video_token_id=VIDEO
        )
