"""Inputs for `sft-train` runs on the GPU machine, made there (nothing large travels):

    python benchmarks/gpu_train_assets.py checkpoint --shape qwen3_5-0.8b --out /tmp/ckpt/0.8b
    python benchmarks/gpu_train_assets.py long-docs --seq-len 32768 --rows 4 --out /tmp/data/long-32k.jsonl

``checkpoint`` builds a benchmark shape (benchmarks/model_step.py's SHAPES: the shipped public configs, some at
reduced depth) as a transformers model, initialised by transformers itself, and writes it with ``save_pretrained``
in bf16, with the shipped tiny tokenizer beside it: a checkpoint folder as a user would point ``model.path`` at.

``long-docs`` writes chat conversations (JSONL, ``messages``) each longer than ``--seq-len`` tokens of the shipped
tokenizer, so that with ``data.overlong = "truncate"`` every packed row is one document of exactly seq_len tokens:
the row ``model_step.py`` times, so the trainer's tokens/s and the model step's compare like for like.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "packages/sft-trainer/src/sft_trainer/assets"


def write_checkpoint(shape: str, out: Path, tokenizer: Path, tiny: bool = False) -> None:
    import transformers
    from model_step import load_shape

    config = load_shape(shape, tiny)
    if tiny:  # room for the shipped tokenizer's 649 tokens
        config.vocab_size = 1024
    config.architectures = None  # transformers writes the class it saves
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    for file in tokenizer.iterdir():
        shutil.copy(file, out / file.name)
    params = sum(p.numel() for p in model.parameters())
    print(f"{shape}: {params / 1e6:.0f}M parameters written by transformers {transformers.__version__} to {out}")


def write_long_docs(seq_len: int, rows: int, out: Path, tokenizer: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    replies = [
        json.loads(line)["messages"][-1]["content"]
        for line in (ASSETS / "tiny_chat.jsonl").read_text().splitlines()
        if line.strip()
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    pool = itertools.cycle(replies)
    with out.open("w") as f:
        for row in range(rows):
            parts = []
            while len(tok(" ".join(parts))["input_ids"]) < seq_len + 256:  # truncation leaves exactly seq_len
                parts += [next(pool) for _ in range(64)]
            messages = [
                {"role": "user", "content": f"Write part {row} of the story."},
                {"role": "assistant", "content": " ".join(parts)},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    print(f"{rows} conversations of > {seq_len} tokens in {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    ckpt = sub.add_parser("checkpoint")
    ckpt.add_argument("--shape", required=True)
    ckpt.add_argument("--out", type=Path, required=True)
    ckpt.add_argument("--tiny", action="store_true", help="toy widths (a CPU check of the path)")
    docs = sub.add_parser("long-docs")
    docs.add_argument("--seq-len", type=int, required=True)
    docs.add_argument("--rows", type=int, default=4)
    docs.add_argument("--out", type=Path, required=True)
    for p in (ckpt, docs):
        p.add_argument("--tokenizer", type=Path, default=ASSETS / "tiny_tokenizer")
    args = parser.parse_args()
    if args.what == "checkpoint":
        write_checkpoint(args.shape, args.out, args.tokenizer, args.tiny)
    else:
        write_long_docs(args.seq_len, args.rows, args.out, args.tokenizer)


if __name__ == "__main__":
    main()
