"""Regenerate the shipped tiny assets: a synthetic chat dataset and a byte-level BPE tokenizer trained on it.

    uv run python packages/sft-trainer/scripts/make_tiny_assets.py            # writes into sft_trainer/assets/
    uv run python packages/sft-trainer/scripts/make_tiny_assets.py --check    # fails if the shipped files differ

Everything is seeded, so the same command writes byte-identical files. The conversations come from a few
templates (arithmetic, copying/reversing words, facts about colors and animals, counting) whose answers are
a deterministic function of the prompt, so a tiny model can visibly lower its loss on them.

Outputs, under ``packages/sft-trainer/src/sft_trainer/assets/``:

- ``tiny_chat.jsonl``: one ``{"messages": [{"role": ..., "content": ...}, ...]}`` per line, 1-3 user/assistant
  turns, sometimes after a system message.
- ``tiny_tokenizer/tokenizer.json`` and ``tokenizer_config.json``: byte-level BPE with the special tokens
  ``<|endoftext|>`` (pad and eos), ``<|im_start|>``, ``<|im_end|>`` and a Qwen-style ChatML chat template;
  loadable with ``transformers.AutoTokenizer.from_pretrained(dir)``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ASSETS = Path(__file__).resolve().parents[1] / "src" / "sft_trainer" / "assets"

SEED = 1234
NUM_CONVERSATIONS = 400
VOCAB_SIZE = 768
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen2.5-style ChatML without a default system prompt: every message is
# "<|im_start|>{role}\n{content}<|im_end|>\n"; the generation prompt is "<|im_start|>assistant\n".
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise assistant. Answer briefly.",
    "You are a careful tutor.",
]

WORDS = [
    "red",
    "blue",
    "green",
    "apple",
    "river",
    "stone",
    "cloud",
    "tiger",
    "house",
    "bread",
    "music",
    "light",
    "paper",
    "water",
    "sun",
    "moon",
    "star",
    "tree",
    "fish",
    "bird",
    "road",
    "door",
    "chair",
    "table",
]

COLORS = {
    "the sky": "blue",
    "grass": "green",
    "snow": "white",
    "coal": "black",
    "a banana": "yellow",
    "a tomato": "red",
    "an orange": "orange",
    "a plum": "purple",
}

ANIMALS = {
    "dog": ("barks", 4),
    "cat": ("meows", 4),
    "cow": ("moos", 4),
    "duck": ("quacks", 2),
    "sheep": ("bleats", 4),
    "owl": ("hoots", 2),
    "horse": ("neighs", 4),
    "hen": ("clucks", 2),
}

NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def _arithmetic(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 50), rng.randint(0, 50)
    op = rng.choice(["+", "-", "*"])
    if op == "*":
        a, b = rng.randint(0, 12), rng.randint(0, 12)
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    prompt = rng.choice([f"What is {a} {op} {b}?", f"Compute {a} {op} {b}.", f"{a} {op} {b} = ?"])
    return prompt, f"{a} {op} {b} = {value}"


def _copy(rng: random.Random) -> tuple[str, str]:
    words = " ".join(rng.sample(WORDS, rng.randint(2, 6)))
    return rng.choice([f"Repeat after me: {words}", f"Copy this: {words}"]), words


def _reverse(rng: random.Random) -> tuple[str, str]:
    words = rng.sample(WORDS, rng.randint(2, 6))
    return f"Reverse the words: {' '.join(words)}", " ".join(reversed(words))


def _color(rng: random.Random) -> tuple[str, str]:
    thing, color = rng.choice(sorted(COLORS.items()))
    prompt = rng.choice([f"What color is {thing}?", f"Tell me the color of {thing}."])
    return prompt, f"{thing.capitalize()} is {color}."


def _animal(rng: random.Random) -> tuple[str, str]:
    animal, (sound, legs) = rng.choice(sorted(ANIMALS.items()))
    if rng.random() < 0.5:
        return f"What sound does a {animal} make?", f"A {animal} {sound}."
    return f"How many legs does a {animal} have?", f"A {animal} has {NUMBER_WORDS[legs]} legs."


def _count(rng: random.Random) -> tuple[str, str]:
    start = rng.randint(0, 20)
    stop = start + rng.randint(2, 8)
    return f"Count from {start} to {stop}.", ", ".join(str(i) for i in range(start, stop + 1))


def _count_words(rng: random.Random) -> tuple[str, str]:
    words = rng.sample(WORDS, rng.randint(1, 7))
    n = len(words)
    return f"How many words are in: {' '.join(words)}", f"There {'is' if n == 1 else 'are'} {n}."


TASKS = [_arithmetic, _copy, _reverse, _color, _animal, _count, _count_words]


def make_conversations(seed: int = SEED, n: int = NUM_CONVERSATIONS) -> list[dict]:
    rng = random.Random(seed)
    conversations = []
    for _ in range(n):
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        for _turn in range(rng.choice([1, 1, 2, 3])):
            prompt, answer = rng.choice(TASKS)(rng)
            messages.append({"role": "user", "content": prompt})
            messages.append({"role": "assistant", "content": answer})
        conversations.append({"messages": messages})
    return conversations


def render_chatml(messages: list[dict]) -> str:
    """The chat template's output, in Python (used only for tokenizer training text)."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def train_tokenizer(conversations: list[dict], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([render_chatml(c["messages"]) for c in conversations], trainer=trainer)
    return tokenizer


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "model_max_length": 4096,
        "padding_side": "right",
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def write_assets(out: Path, seed: int = SEED) -> list[Path]:
    conversations = make_conversations(seed)
    tok_dir = out / "tiny_tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    data_path = out / "tiny_chat.jsonl"
    data_path.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in conversations), encoding="utf-8")
    tokenizer = train_tokenizer(conversations)
    (tok_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n", encoding="utf-8")
    return [data_path, tok_dir / "tokenizer.json", tok_dir / "tokenizer_config.json"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ASSETS, help="assets directory (default: the package's)")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--check", action="store_true", help="regenerate into a temp dir and compare with --out")
    args = parser.parse_args(argv)
    if not args.check:
        for path in write_assets(args.out, args.seed):
            print(f"wrote {path} ({path.stat().st_size} bytes)")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = write_assets(Path(tmp), args.seed)
        stale = [
            p.relative_to(tmp)
            for p in fresh
            if not (args.out / p.relative_to(tmp)).is_file()
            or p.read_bytes() != (args.out / p.relative_to(tmp)).read_bytes()
        ]
    for rel in stale:
        print(f"differs from a fresh build: {args.out / rel}", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
