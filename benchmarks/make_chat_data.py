"""Write a synthetic chat dataset for the data-scale benchmark (benchmarks/data_scale.py).

Every line is ``{"messages": [...]}``: an optional system prompt and 1-3 user/assistant turns of random words, the
message lengths log-normal (user ~30 words, assistant ~100 words on average, a long tail), so that about 2.3 KB and,
with the shipped tiny tokenizer, about 1,250 tokens make one conversation. Deterministic for a seed.

    python benchmarks/make_chat_data.py --out /tmp/chat100k.jsonl --conversations 100000
    python benchmarks/make_chat_data.py --out /tmp/vl10k --conversations 10000 --images 20000   # with images
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

SYLLABLES = ["ka", "lo", "mi", "ren", "tu", "sa", "vel", "do", "ri", "na", "po", "the", "an", "is", "of", "ble", "ter"]


def _vocabulary(rng: np.random.Generator, size: int = 4000) -> list[str]:
    words = set()
    while len(words) < size:
        words.add("".join(rng.choice(SYLLABLES, rng.integers(1, 4))))
    return sorted(words)


def _text(rng: np.random.Generator, words: list[str], mu: float, sigma: float) -> str:
    n = max(1, min(3000, int(math.exp(rng.normal(mu, sigma)))))
    picked = rng.integers(0, len(words), n)
    return " ".join(words[i] for i in picked.tolist())


def _image(rng: np.random.Generator, folder: Path, index: int) -> str:
    from PIL import Image

    name = f"img{index:06d}.png"
    side = int(rng.integers(24, 72))
    pixels = rng.integers(0, 256, (side, side + int(rng.integers(0, 16)), 3), dtype=np.uint8)
    Image.fromarray(pixels).save(folder / name)
    return f"images/{name}"


def write(out: Path, conversations: int, seed: int = 0, images: int = 0) -> Path:
    """Write the dataset; with ``images``, ``out`` is a folder holding ``data.jsonl`` and ``images/``, and the
    images are spread over the first user messages (two per conversation on average for 10k / 20k)."""
    rng = np.random.default_rng(seed)
    words = _vocabulary(rng)
    if images:
        (out / "images").mkdir(parents=True, exist_ok=True)
        path = out / "data.jsonl"
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        path = out
    per_conversation = np.bincount(rng.integers(0, conversations, images), minlength=conversations) if images else None
    made = 0
    with path.open("w") as f:
        for c in range(conversations):
            messages = []
            if rng.random() < 0.3:
                messages.append({"role": "system", "content": _text(rng, words, 2.1, 0.5)})
            for turn in range(int(rng.integers(1, 4))):
                user: str | list = _text(rng, words, 3.1, 0.8)
                if per_conversation is not None and turn == 0 and per_conversation[c]:
                    parts = [
                        {"type": "image", "image": _image(rng, out / "images", made + k)}
                        for k in range(int(per_conversation[c]))
                    ]
                    made += len(parts)
                    user = [*parts, {"type": "text", "text": user}]
                messages.append({"role": "user", "content": user})
                messages.append({"role": "assistant", "content": _text(rng, words, 4.2, 0.9)})
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--conversations", type=int, default=100_000)
    parser.add_argument("--images", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    path = write(args.out, args.conversations, args.seed, args.images)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
