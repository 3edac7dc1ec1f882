"""Regenerate the shipped tiny vision-language assets: a processor folder and a small image chat dataset.

    uv run python packages/sft-trainer/scripts/make_tiny_vl_assets.py            # writes into sft_trainer/assets/
    uv run python packages/sft-trainer/scripts/make_tiny_vl_assets.py --check    # fails if the shipped files differ

Everything is seeded (pictures drawn with numpy, PNGs written by the locked Pillow), so the same command writes
byte-identical files. Outputs, under ``packages/sft-trainer/src/sft_trainer/assets/``:

- ``tiny_vl_processor/``: the shipped tiny tokenizer (``tiny_tokenizer``, its ids unchanged) with Qwen-VL's vision
  tokens ``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``, ``<|video_pad|>`` appended as special tokens;
  a ChatML template that also renders list contents (text parts as their text, each image part as
  ``<|vision_start|><|image_pad|><|vision_end|>``); and ``preprocessor_config.json`` for transformers' Qwen2-VL
  image processor (patch 8, temporal patch 2, merge 2, 256..4096 pixels, mean/std 0.5).
- ``tiny_vl_chat/data.jsonl`` and ``tiny_vl_chat/images/*.png``: 48 conversations about generated pictures (24..64
  px a side, not square): a shape's color and kind, counts of dots, stripe directions, checkerboards, the
  background color, and comparisons of two pictures; answers follow from the pictures. Most have one image, some
  two (in one user turn, or one per turn), some a follow-up question, and a few none. Image parts reference
  files relative to the JSONL file: ``{"type": "image", "image": "images/0007.png"}``.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image
from tokenizers import AddedToken, Tokenizer

ASSETS = Path(__file__).resolve().parents[1] / "src" / "sft_trainer" / "assets"
SEED = 4321
# Appended in Qwen's order (its ids run vision start, vision end, ..., image pad, video pad).
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

# The tiny tokenizer's ChatML, with list contents: "<|im_start|>{role}\n{content}<|im_end|>\n" per message, the
# generation prompt "<|im_start|>assistant\n".
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}"
    "{{- message['content'] }}"
    "{%- else %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}"
    "{{- part['text'] }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# `size` is the form transformers 5.x writes; 5.17 and 5.24 read it without warnings (min_pixels/max_pixels are
# its legacy spelling).
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "do_resize": True,
    "size": {"shortest_edge": 256, "longest_edge": 4096},
    "patch_size": 8,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_convert_rgb": True,
}

SIDES = [24, 32, 40, 48, 56, 64]
BACKGROUNDS = {"white": (245, 245, 245), "gray": (150, 150, 150)}
COLORS = {
    "red": (220, 30, 30),
    "green": (30, 170, 60),
    "blue": (40, 60, 220),
    "yellow": (235, 210, 30),
    "purple": (140, 40, 170),
}
INK = (20, 20, 20)
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six"]
SYSTEM_PROMPT = "You are a careful assistant. Look at the pictures and answer briefly."

# How many conversations of each kind (48 in all), shuffled with the seed.
KINDS = {"single": 28, "pair": 6, "across": 6, "follow_up": 3, "text": 5}


class Picture:
    """A canvas of a random non-square size on a named background."""

    def __init__(self, rng: random.Random):
        h = rng.choice(SIDES)
        w = rng.choice([s for s in SIDES if s != h])
        self.background = rng.choice(sorted(BACKGROUNDS))
        self.pixels = np.empty((h, w, 3), dtype=np.uint8)
        self.pixels[:] = BACKGROUNDS[self.background]

    @property
    def shape(self) -> tuple[int, int]:
        return self.pixels.shape[0], self.pixels.shape[1]


def _shape(rng: random.Random) -> tuple[Picture, str, str]:
    picture = Picture(rng)
    h, w = picture.shape
    color, kind = rng.choice(sorted(COLORS)), rng.choice(["square", "circle", "triangle"])
    size = min(h, w) * 3 // 4
    top, left = rng.randint(0, h - size), rng.randint(0, w - size)
    y, x = np.mgrid[0:size, 0:size]
    if kind == "square":
        inside = np.ones((size, size), dtype=bool)
    elif kind == "circle":
        inside = (y - (size - 1) / 2) ** 2 + (x - (size - 1) / 2) ** 2 <= (size / 2) ** 2
    else:  # apex at the top, widening downwards
        inside = np.abs(x - (size - 1) / 2) <= (y + 1) / 2
    picture.pixels[top : top + size, left : left + size][inside] = COLORS[color]
    if rng.random() < 0.5:
        return picture, f"What color is the {kind}?", f"The {kind} is {color}."
    return picture, "What shape is in the picture?", f"It is a {color} {kind}."


def _dots(rng: random.Random, count: int | None = None) -> tuple[Picture, str, str]:
    picture = Picture(rng)
    h, w = picture.shape
    count = rng.randint(1, 6) if count is None else count
    cells = [(r, c) for r in range(2, h - 5, 8) for c in range(2, w - 5, 8)]  # 4 px dots, 4 px apart at least
    for r, c in rng.sample(cells, count):
        picture.pixels[r : r + 4, c : c + 4] = INK
    answer = "There is one dot." if count == 1 else f"There are {NUMBER_WORDS[count]} dots."
    return picture, "How many dots are there?", answer


def _stripes(rng: random.Random) -> tuple[Picture, str, str]:
    picture = Picture(rng)
    vertical = rng.random() < 0.5
    if vertical:
        for k in range(0, picture.shape[1], 8):
            picture.pixels[:, k : k + 4] = INK
    else:
        for k in range(0, picture.shape[0], 8):
            picture.pixels[k : k + 4, :] = INK
    direction = "vertical" if vertical else "horizontal"
    return picture, "Are the stripes horizontal or vertical?", f"The stripes are {direction}."


def _pattern(rng: random.Random) -> tuple[Picture, str, str]:
    if rng.random() < 0.5:
        picture, _, _ = _stripes(rng)
        return picture, "Is this a checkerboard or stripes?", "It is stripes."
    picture = Picture(rng)
    h, w = picture.shape
    y, x = np.mgrid[0:h, 0:w]
    picture.pixels[(y // 8 + x // 8) % 2 == 1] = rng.choice(list(COLORS.values()))
    return picture, "Is this a checkerboard or stripes?", "It is a checkerboard."


def _background(rng: random.Random) -> tuple[Picture, str, str]:
    picture, _, _ = _dots(rng)
    return picture, "What color is the background?", f"The background is {picture.background}."


SINGLE_TASKS = [_shape, _dots, _stripes, _pattern, _background]


def _pair(rng: random.Random) -> tuple[list[Picture], str, str]:
    if rng.random() < 0.5:
        dark, light = rng.randint(20, 90), rng.randint(170, 250)
        first, second = Picture(rng), Picture(rng)
        first_brighter = rng.random() < 0.5
        first.pixels[:] = light if first_brighter else dark
        second.pixels[:] = dark if first_brighter else light
        which = "first" if first_brighter else "second"
        return [first, second], "Which picture is brighter, the first or the second?", f"The {which} is brighter."
    a, b = rng.sample(range(1, 7), 2)
    first, second = _dots(rng, a)[0], _dots(rng, b)[0]
    which = "first" if a > b else "second"
    return [first, second], "Which picture has more dots, the first or the second?", f"The {which} has more dots."


def _text_turn(rng: random.Random) -> tuple[str, str]:
    if rng.random() < 0.5:
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        return f"What is {a} + {b}?", f"{a} + {b} = {a + b}."
    word = rng.choice(["red", "stone", "river", "cloud", "tiger", "light", "paper"])
    return f"How many letters are in the word {word}?", f"The word {word} has {NUMBER_WORDS[len(word)]} letters."


def _png(picture: Picture) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(picture.pixels).save(buffer, format="PNG", compress_level=9)
    return buffer.getvalue()


def make_dataset(seed: int = SEED) -> tuple[list[dict], dict[str, bytes]]:
    """The conversations and their PNG files (relative path -> bytes)."""
    rng = random.Random(seed)
    files: dict[str, bytes] = {}

    def user(pictures: list[Picture], question: str) -> dict:
        if not pictures:
            return {"role": "user", "content": question}
        parts = []
        for picture in pictures:
            name = f"images/{len(files):04d}.png"
            files[name] = _png(picture)
            parts.append({"type": "image", "image": name})
        text = {"type": "text", "text": question}
        parts = [text, *parts] if rng.random() < 0.25 else [*parts, text]  # the question before or after
        return {"role": "user", "content": parts}

    def reply(answer: str) -> dict:
        return {"role": "assistant", "content": answer}

    schedule = [kind for kind, n in KINDS.items() for _ in range(n)]
    rng.shuffle(schedule)
    conversations = []
    for kind in schedule:
        messages = [{"role": "system", "content": SYSTEM_PROMPT}] if rng.random() < 0.15 else []
        if kind == "single":
            picture, question, answer = rng.choice(SINGLE_TASKS)(rng)
            messages += [user([picture], question), reply(answer)]
        elif kind == "pair":
            pictures, question, answer = _pair(rng)
            messages += [user(pictures, question), reply(answer)]
        elif kind == "across":
            for _ in range(2):
                picture, question, answer = rng.choice(SINGLE_TASKS)(rng)
                messages += [user([picture], question), reply(answer)]
        elif kind == "follow_up":  # a second question about the first turn's picture
            picture, question, answer = rng.choice([_shape, _dots, _stripes])(rng)
            messages += [user([picture], question), reply(answer)]
            messages += [user([], "What color is the background?"), reply(f"The background is {picture.background}.")]
        else:
            for _ in range(rng.choice([1, 1, 2])):
                question, answer = _text_turn(rng)
                messages += [user([], question), reply(answer)]
        conversations.append({"messages": messages})
    return conversations, files


def processor_files(tokenizer_dir: Path) -> dict[str, str]:
    """The processor folder's files (name -> text) from the tiny tokenizer's folder."""
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    ids = [tokenizer.token_to_id(t) for t in VISION_TOKENS]
    assert ids == list(range(size, size + len(VISION_TOKENS))), ids  # appended; every existing id kept
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["additional_special_tokens"] = [*config["additional_special_tokens"], *VISION_TOKENS]
    config["chat_template"] = CHAT_TEMPLATE
    return {
        "tokenizer.json": tokenizer.to_str(pretty=True) + "\n",
        "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
        "preprocessor_config.json": json.dumps(PREPROCESSOR, indent=2) + "\n",
    }


def write_assets(out: Path, seed: int = SEED) -> list[Path]:
    """Write both folders under ``out`` (stale PNGs of an earlier build removed); returns the files written."""
    written = []
    processor = out / "tiny_vl_processor"
    processor.mkdir(parents=True, exist_ok=True)
    for name, text in processor_files(ASSETS / "tiny_tokenizer").items():
        (processor / name).write_text(text, encoding="utf-8")
        written.append(processor / name)
    conversations, files = make_dataset(seed)
    data = out / "tiny_vl_chat"
    (data / "images").mkdir(parents=True, exist_ok=True)
    for old in (data / "images").glob("*.png"):
        if f"images/{old.name}" not in files:
            old.unlink()
    for name, blob in files.items():
        (data / name).write_bytes(blob)
        written.append(data / name)
    lines = "".join(json.dumps(c) + "\n" for c in conversations)
    (data / "data.jsonl").write_text(lines, encoding="utf-8")
    written.append(data / "data.jsonl")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ASSETS, help="assets directory (default: the package's)")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--check", action="store_true", help="regenerate into a temp dir and compare with --out")
    args = parser.parse_args(argv)
    if not args.check:
        written = write_assets(args.out, args.seed)
        print(f"wrote {len(written)} files ({sum(p.stat().st_size for p in written)} bytes) under {args.out}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.relative_to(tmp): p.read_bytes() for p in write_assets(Path(tmp), args.seed)}
    shipped = {p.relative_to(args.out) for p in (args.out / "tiny_vl_chat" / "images").glob("*.png")}
    problems = [
        f"differs from a fresh build: {args.out / rel}" for rel, blob in fresh.items() if _read(args.out / rel) != blob
    ]
    problems += [f"not made by a fresh build: {args.out / rel}" for rel in sorted(shipped - fresh.keys())]
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


def _read(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


if __name__ == "__main__":
    raise SystemExit(main())
