"""End-to-end CPU runs of ``sft-train`` with the tiny Qwen3.5-VL: cp = 2 equals cp = 1 in both vision modes, dp x cp
with FSDP over rows where one replica's row has no image (no deadlock, same numbers), the HF export loads in
transformers' Qwen3_5ForConditionalGeneration with our logits, and a tokenizer whose vision ids do not match the
model is refused before any worker starts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trainer_runs import STEPS, _assert_same_run, _train_runs

from sft_trainer.config import SHIPPED_VL_DATA, SHIPPED_VL_PROCESSOR, load_config
from sft_trainer.data import build_training_rows, load_image_processor

VL = ("--config", "tiny_vl_cpu")


# vl_runs (conftest.py): cp = 1, and cp = 2 in both vision modes, trained once for this module and the checkpoint one.


@pytest.mark.parametrize("vision_cp", ["shard", "replicate"])
def test_vl_cp2_fsdp_equals_cp1(vl_runs, vision_cp):
    _assert_same_run(vl_runs["cp1"], vl_runs[vision_cp])
    assert all(m["tokens"] > 0 for m in vl_runs[vision_cp][1])


def test_vl_export_loads_in_transformers(vl_runs):
    """The export is a transformers VL checkpoint (with the tokenizer and the image processor): transformers' model
    and ours loaded from it give the same logits on a shipped conversation with its image."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from cp_vlm import Qwen35VLForConditionalGeneration
    from sft_trainer.data import load_conversations, tokenize_conversation

    out, _ = vl_runs["cp1"]
    hf = AutoModelForImageTextToText.from_pretrained(out / "hf").eval()
    assert type(hf).__name__ == "Qwen3_5ForConditionalGeneration"
    ours = Qwen35VLForConditionalGeneration.from_pretrained(out / "hf")
    tokenizer, processor = AutoTokenizer.from_pretrained(out / "hf"), load_image_processor(out / "hf")
    messages = load_conversations(SHIPPED_VL_DATA)[0].messages
    doc = tokenize_conversation(tokenizer, messages, image_processor=processor, base_dir=SHIPPED_VL_DATA.parent)
    ids = torch.tensor(doc.input_ids)
    with torch.no_grad():
        ref = hf(
            input_ids=ids[None],
            pixel_values=doc.pixel_values,
            image_grid_thw=doc.image_grid_thw,
            mm_token_type_ids=(ids == hf.config.image_token_id).int()[None],
        ).logits[0]
        got = ours(ids, [ids.numel()], pixel_values=doc.pixel_values, image_grid_thw=doc.image_grid_thw).logits
    assert ((got - ref).abs().max() / ref.abs().max()) < 1e-5


def _mixed_dataset(folder: Path) -> Path:
    """Image conversations and long text-only ones, each text-only one filling a 128-token row by itself."""
    shutil.copytree(SHIPPED_VL_DATA.parent / "images", folder / "images")
    lines = []
    for i in range(12):
        if i % 3 == 1:  # 120 tokens: no image conversation (31-41 tokens) fits beside it in a 128-token row
            text = " ".join(["red blue green"] * 18)
            messages = [{"role": "user", "content": f"Repeat: {text}"}, {"role": "assistant", "content": text}]
        else:
            parts = [{"type": "image", "image": f"images/{i:04d}.png"}, {"type": "text", "text": "What is it?"}]
            messages = [{"role": "user", "content": parts}, {"role": "assistant", "content": "A picture."}]
        lines.append(json.dumps({"messages": messages}))
    path = folder / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_vl_dp2_cp2_fsdp_with_text_only_rows_equals_cp1(tmp_path):
    """4 ranks, FSDP over all of them: at some step one replica's row has images and the other's none. Every rank
    still issues the same collectives (the tower is in FSDP's root unit and gets zero gradients where it ran on
    nothing), so nothing hangs, and the run equals one process accumulating the same rows."""
    data = _mixed_dataset(tmp_path)
    data_args = ("--data.path", str(data), "--data.seq_len", "128")
    cfg = load_config("tiny_vl_cpu", list(data_args))
    from transformers import AutoTokenizer

    rows, _ = build_training_rows(
        cfg,
        AutoTokenizer.from_pretrained(SHIPPED_VL_PROCESSOR),
        image_processor=load_image_processor(SHIPPED_VL_PROCESSOR),
    )
    has_images = [r.image_grid_thw is not None for r in rows]
    # Step s feeds rows 2s (replica 0) and 2s + 1 (replica 1): some step must mix a text-only row with an image one.
    assert any(has_images[2 * s] != has_images[2 * s + 1] for s in range(min(STEPS, len(rows) // 2))), has_images
    ref, got = _train_runs(
        (tmp_path / "cp1", (*VL, *data_args, "--parallel.cp", "1", "--parallel.fsdp", "false")),
        (tmp_path / "dp2cp2", (*VL, *data_args, "--parallel.cp", "2", "--parallel.dp", "2", "--train.grad_accum", "1")),
    )
    _assert_same_run((tmp_path / "cp1", ref), (tmp_path / "dp2cp2", got))


def test_tokenizer_without_the_models_vision_ids_is_refused(tmp_path):
    """A VL model whose image token id is not the tokenizer's would put images on the wrong tokens: refused."""
    from sft_trainer.config import tiny_qwen35_vl_config

    ckpt = tmp_path / "model"
    tiny_qwen35_vl_config(vocab_size=653, image_token_id=10, vision_start_token_id=11).save_pretrained(ckpt)
    cmd = [sys.executable, "-c", "from sft_trainer.cli import main; main()", *VL, "--model.config", str(ckpt)]
    cmd += ["--output_dir", str(tmp_path / "out"), "--train.steps", "1", "--train.warmup_steps", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "does not match the VL model" in output and "Traceback" not in output
    assert "image_token_id=10 but the tokenizer's <|image_pad|> is 651" in output
    assert "vision_start_token_id=11 but the tokenizer's <|vision_start|> is 649" in output
    assert not (tmp_path / "out").exists()  # refused before launch: no worker started
