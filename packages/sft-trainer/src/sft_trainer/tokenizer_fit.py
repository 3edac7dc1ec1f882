"""Whether a tokenizer fits a model: every id it can produce, its special tokens and (VL) its image placeholders
must be rows of the model's embedding, checked before any worker starts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Files of which one marks a folder as holding a tokenizer that AutoTokenizer can load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# VL config field -> the placeholder's name in sft_trainer.data.VisionTokens; the ones a packed row relies on.
_CHECKED_VISION_FIELDS = {"image_token_id": "image_pad", "vision_start_token_id": "vision_start"}
# Text files of a tokenizer folder that transformers reads; a broken one is named before its loader's error
_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.json")
_TEXT_FILES = (*_JSON_FILES, "chat_template.jinja")


def holds_tokenizer(folder: str | Path) -> bool:
    """Whether ``folder`` holds tokenizer files (a checkpoint saved with its tokenizer does)."""
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


def tokenizer_file_problem(folder: str | Path) -> str | None:
    """Which of ``folder``'s tokenizer files is not UTF-8 text or (a JSON file) not valid JSON, or None: the
    loaders' own errors do not name the file."""
    for name in _TEXT_FILES:
        path = Path(folder) / name
        if not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
            if name in _JSON_FILES:
                json.loads(text)
        except UnicodeDecodeError as exc:
            return f"{name} is not UTF-8 text ({exc.reason} at byte {exc.start})"
        except ValueError as exc:
            return f"{name} is not valid JSON ({exc})"
    return None


def load_tokenizer(folder: str | Path) -> Any:
    """The tokenizer of ``folder`` (AutoTokenizer; never remote code)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)


def tokenizer_problems(
    tokenizer: Any, hf_config: Any, field: str, source: str, checkpoints_own: bool = False
) -> list[str]:
    """One line per way ``tokenizer`` (named by ``field``, e.g. "data.tokenizer='x'") does not fit the model of
    ``hf_config`` (named by ``source``): an id at or past ``vocab_size``, a special token outside it, or a VL
    placeholder whose id differs from the config's. ``checkpoints_own``: the tokenizer is the one the checkpoint
    folder holds, so the fix is in that folder or another tokenizer, not "use the checkpoint's own"."""
    fix = (
        "the checkpoint's own tokenizer and its config.json disagree: fix vocab_size there, or set data.tokenizer "
        "to the tokenizer made for this checkpoint"
        if checkpoints_own
        else "use the checkpoint's own tokenizer (the default for model.path) or one made for it"
    )
    text = getattr(hf_config, "text_config", None) or hf_config
    vocab = int(text.vocab_size)
    problems = []
    size = len(tokenizer)
    top = max(tokenizer.get_vocab().values(), default=-1)
    if max(size, top + 1) > vocab:
        problems.append(
            f"{field} has {size} tokens (ids up to {top}) but {source} has vocab_size={vocab}: its ids must be "
            f"below vocab_size; {fix}"
        )
    special = {str(t): tokenizer.convert_tokens_to_ids(t) for t in tokenizer.all_special_tokens}
    outside = {t: i for t, i in special.items() if not isinstance(i, int) or not 0 <= i < vocab}
    if outside and not problems:
        problems.append(f"{field}: special tokens {outside} lie outside the {vocab}-row embedding of {source}; {fix}")
    if getattr(hf_config, "vision_config", None) is not None:
        from sft_trainer.data import VisionTokens

        ids = VisionTokens().ids(tokenizer)
        wrong = [
            f"{name}={getattr(hf_config, name)} but the tokenizer's {getattr(VisionTokens(), token)} is "
            f"{ids.get(token, 'absent')}"
            for name, token in _CHECKED_VISION_FIELDS.items()
            if ids.get(token) != getattr(hf_config, name, None)
        ]
        if wrong:
            problems.append(f"{field} does not match the VL model {source}: {'; '.join(wrong)}")
    return problems
