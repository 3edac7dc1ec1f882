"""Qwen3.5-VL (dense and MoE) on CPU in fp32 against transformers' Qwen3_5(Moe)ForConditionalGeneration.

transformers' GDN fallback does not keep packed documents apart, so our model runs the packed row and
transformers' model runs each document alone (with that document's images); logits must match per document, and
the parameter gradients of a loss over the packed row (vision tower included) must equal the sum of the
per-document gradients. Weights are randomized on the transformers side, saved with ``save_pretrained`` and loaded
with our ``from_pretrained``, so every parity test goes through the real checkpoint path.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    AutoModelForImageTextToText,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForConditionalGeneration,
)
from vl_cases import IMG, PIXEL_DIM, VIDEO, VOCAB, VSTART, build_row, make_config, randomize_

from cp_core import ContextParallelError
from cp_core.testing import relative_max
from cp_models import Qwen35ForCausalLM
from cp_vlm import Qwen35VLForConditionalGeneration, balance_images

TOL = 1e-5  # logits, relative to their largest magnitude
GRAD_TOL = 1e-4  # parameter gradients (fp32 rounding noise of these random models, as in cp-models' tests)

ROWS = {
    # text | image | text, a text-only document, two images back to back, a 1-token document
    "mixed": [[3, (1, 4, 6), 2], [5], [1, (1, 2, 2), (1, 4, 4), 3], [1]],
    "image_first_and_last": [[(1, 4, 4)], [2, (1, 6, 2)]],
    "text_only_row": [[7], [4, 2]],
}


def hf_class(moe: bool):
    return Qwen3_5MoeForConditionalGeneration if moe else Qwen3_5ForConditionalGeneration


def build_pair(tmp_path, moe: bool, tie: bool, seed: int = 0):
    torch.manual_seed(seed)
    config = make_config(moe, tie)
    hf = randomize_(hf_class(moe)(config).float(), seed).eval()
    hf.config.text_config._attn_implementation = "eager"
    hf.config.vision_config._attn_implementation = "eager"
    hf.save_pretrained(tmp_path / "hf")
    ours = Qwen35VLForConditionalGeneration.from_pretrained(tmp_path / "hf", vision_attention="eager")
    return hf, ours


def hf_doc_logits(hf, ids, grids, pixels):
    kwargs = {}
    if grids:
        kwargs = dict(
            pixel_values=torch.cat(pixels),
            image_grid_thw=torch.tensor(grids),
            mm_token_type_ids=(ids == IMG).int()[None],
        )
    return hf(input_ids=ids[None], use_cache=False, **kwargs).logits[0]


@pytest.mark.parametrize("moe,tie", [(False, False), (False, True), (True, False)], ids=["dense", "dense_tied", "moe"])
@pytest.mark.parametrize("row_name", list(ROWS))
def test_parity_with_transformers_per_document(tmp_path, moe, tie, row_name):
    hf, ours = build_pair(tmp_path, moe, tie, seed=len(row_name))
    if tie:
        assert ours.lm_head.weight is ours.model.language_model.embed_tokens.weight
    row = build_row(ROWS[row_name], seed=3)
    weights = torch.randn(row["input_ids"].numel(), VOCAB, generator=torch.Generator().manual_seed(4))
    labels = torch.randint(0, VOCAB, row["input_ids"].shape, generator=torch.Generator().manual_seed(5))

    out = ours(
        row["input_ids"],
        row["seq_lens"],
        pixel_values=row["pixel_values"],
        image_grid_thw=row["image_grid_thw"],
        labels=labels,
        return_logits=True,
    )
    (out.logits * weights).sum().backward()
    ours_grads = {n: p.grad for n, p in ours.named_parameters()}
    assert all(g is not None for g in ours_grads.values()), [n for n, g in ours_grads.items() if g is None]

    start = 0
    for ids, grids, pixels in row["docs"]:
        part = slice(start, start + ids.numel())
        ref = hf_doc_logits(hf, ids, grids, pixels)
        assert relative_max(out.logits[part].detach(), ref.detach()) < TOL, part
        ref_logp = torch.log_softmax(ref, -1).gather(1, labels[part, None]).squeeze(1)
        assert relative_max(out.token_log_probs[part].detach(), ref_logp.detach()) < TOL
        (ref * weights[part]).sum().backward()
        start += ids.numel()
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    assert ours_grads.keys() == hf_grads.keys()
    worst = {}
    for name, grad in ours_grads.items():
        ref = hf_grads[name]
        if ref is None:  # transformers never used it (no image in the row): ours must be exactly zero
            assert row["image_grid_thw"] is None and "visual" in name, name
            assert torch.count_nonzero(grad) == 0, name
            continue
        worst[name] = relative_max(grad, ref)
    bad = {n: e for n, e in worst.items() if e > GRAD_TOL}
    assert not bad, bad
    if row["image_grid_thw"] is not None:
        assert any("visual" in n for n in worst)  # the vision tower's gradients were compared


def test_checkpoint_round_trip_both_ways(tmp_path):
    hf, ours = build_pair(tmp_path, moe=True, tie=False, seed=7)
    ours.save_pretrained(tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    back = AutoModelForImageTextToText.from_pretrained(tmp_path / "ours").float().eval()
    assert type(back) is Qwen3_5MoeForConditionalGeneration
    back.config.text_config._attn_implementation = "eager"
    back.config.vision_config._attn_implementation = "eager"
    hf_state, back_state = hf.state_dict(), back.state_dict()
    assert hf_state.keys() == back_state.keys()
    for name, tensor in hf_state.items():
        assert torch.equal(tensor, back_state[name]), name
    row = build_row(ROWS["mixed"], seed=1)
    ids, grids, pixels = row["docs"][0]
    with torch.no_grad():
        torch.testing.assert_close(hf_doc_logits(back, ids, grids, pixels), hf_doc_logits(hf, ids, grids, pixels))
    # ours -> ours: identical weights
    again = Qwen35VLForConditionalGeneration.from_pretrained(tmp_path / "ours")
    for (name, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_tied_checkpoint_and_text_only_loading(tmp_path):
    _, ours = build_pair(tmp_path, moe=False, tie=True, seed=2)
    ours.save_pretrained(tmp_path / "ours")
    from safetensors.torch import load_file

    keys = load_file(str(tmp_path / "ours" / "model.safetensors")).keys()
    assert "lm_head.weight" not in keys and "model.visual.pos_embed.weight" in keys
    # The text part of a VL checkpoint loads as a causal LM (vision dropped, head tied by the VL flag).
    text = Qwen35ForCausalLM.from_pretrained(tmp_path / "ours")
    assert text.lm_head.weight is text.model.embed_tokens.weight
    ids = torch.randint(0, 80, (9,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(text(ids, [9]).logits, ours(ids, [9]).logits, rtol=0, atol=0)


def test_balance_images_by_patch_count():
    assert balance_images([16, 4, 4, 8], 2) == [[0], [1, 2, 3]]
    assert balance_images([4, 4], 4) == [[0], [1], [], []]
    assert balance_images([], 2) == [[], []]
    loads = [sum([9, 7, 5, 5, 3, 2, 1][i] for i in r) for r in balance_images([9, 7, 5, 5, 3, 2, 1], 3)]
    assert max(loads) - min(loads) <= 2 and sum(loads) == 32


def _call(model, row, **overrides):
    kwargs = dict(pixel_values=row["pixel_values"], image_grid_thw=row["image_grid_thw"])
    kwargs.update(overrides)
    return model(overrides.pop("input_ids", row["input_ids"]), row["seq_lens"], **kwargs)


def test_bad_inputs_raise_clearly(tmp_path):
    _, ours = build_pair(tmp_path, moe=False, tie=False)
    row = build_row([[2, (1, 4, 4), 2]], seed=0)  # 2 + 1 + 4 + 1 + 2 = 10 tokens, one image of 16 patches
    with pytest.raises(ContextParallelError, match=r"pixel_values has shape \(15, 96\).*needs 16 patch rows"):
        _call(ours, row, pixel_values=row["pixel_values"][:15])
    with pytest.raises(ContextParallelError, match=r"pass pixel_values and image_grid_thw together"):
        _call(ours, row, image_grid_thw=None)
    with pytest.raises(ContextParallelError, match=r"found 1 image-token runs .* has 2 grids"):
        _call(ours, row, image_grid_thw=torch.tensor([[1, 4, 4], [1, 2, 2]]), pixel_values=torch.zeros(20, PIXEL_DIM))
    with pytest.raises(ContextParallelError, match=r"has 4 tokens but its grid"):  # image tokens vs grid
        _call(ours, row, image_grid_thw=torch.tensor([[1, 4, 6]]), pixel_values=torch.zeros(24, PIXEL_DIM))
    text = torch.tensor([1, 2, VSTART, 5, 6])
    with pytest.raises(ContextParallelError, match=r"found 0 image-token runs .* has 1 grids"):  # image, no tokens
        ours(text, [5], pixel_values=torch.zeros(4, PIXEL_DIM), image_grid_thw=torch.tensor([[1, 2, 2]]))
    with pytest.raises(ContextParallelError, match=r"videos are not supported"):
        ours(torch.tensor([1, VIDEO, 2]), [3])
    with pytest.raises(ContextParallelError, match=r"labels \(9,\) must be the whole row"):
        _call(ours, row, labels=torch.zeros(9, dtype=torch.long))
    with pytest.raises(ContextParallelError, match=r"seq_lens"):
        ours(row["input_ids"], [4, 4], pixel_values=row["pixel_values"], image_grid_thw=row["image_grid_thw"])
    with pytest.raises(ContextParallelError, match=r"unknown vision_cp 'split'"):
        Qwen35VLForConditionalGeneration(make_config(), vision_cp="split")
    from transformers import Qwen3_5TextConfig

    with pytest.raises(ContextParallelError, match=r"not a Qwen3.5-VL config.*Qwen35ForCausalLM"):
        Qwen35VLForConditionalGeneration(Qwen3_5TextConfig())
