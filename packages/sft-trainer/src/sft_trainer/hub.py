"""Hugging Face Hub ids for ``model.path`` and ``data.tokenizer``, as transformers takes them: a value that is not
an existing local path but reads as ``org/name`` is fetched into the hub cache (only config, weights and tokenizer
files; no code, which never runs) and replaced by the local snapshot folder before anything else reads it."""

from __future__ import annotations

import re
from pathlib import Path

# huggingface_hub's repo-id rule: one "/", names of letters, digits, "-", "_", "."; not starting with "." or "-"
HUB_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9_][A-Za-z0-9_.-]{0,95}$")
TOKENIZER_FILES = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
]
CONFIG_FILES = ["config.json", "generation_config.json"]
WEIGHT_FILES = ["*.safetensors", "*.safetensors.index.json"]


def is_hub_id(value: str) -> bool:
    """Whether ``value`` names a hub repository rather than a local path (it does not exist here and reads as
    ``org/name``; ``./org/name`` or an absolute path is always local)."""
    return not Path(value).exists() and bool(HUB_ID.match(value)) and ".." not in value


def resolve_hub_id(value: str, field: str, patterns: list[str]) -> str:
    """The local snapshot folder of hub repository ``value`` with the files matching ``patterns`` (downloaded
    unless cached). Raises ValueError with one line naming ``field``, the id and HF_HUB_OFFLINE when it cannot."""
    from huggingface_hub import constants, snapshot_download

    try:
        return snapshot_download(repo_id=value, allow_patterns=patterns)
    except Exception as exc:  # offline, not cached, no such repository, gated, no network: one line
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if constants.HF_HUB_OFFLINE:
            how = (
                f"HF_HUB_OFFLINE=1 and it is not in the hub cache ({constants.HF_HUB_CACHE}); download it once with "
                "HF_HUB_OFFLINE unset, or give a local folder"
            )
        else:
            how = (
                f"the Hugging Face Hub did not provide it ({type(exc).__name__}: {reason}); check the id and the "
                "network, set HF_HUB_OFFLINE=1 to use the hub cache only, or give a local folder"
            )
        raise ValueError(f"{field}={value!r} is not a local path, and as a Hugging Face Hub id: {how}") from None


def resolve_hub_ids(cfg, fetch_weights: bool = True) -> list[str]:
    """Replace hub ids in ``model.path`` (config, tokenizer and, with ``fetch_weights``, weights) and
    ``data.tokenizer`` by their local snapshot folders, in place. Returns the problems (empty: all local now)."""
    problems = []
    targets = [
        ("model.path", cfg.model, "path", CONFIG_FILES + TOKENIZER_FILES + (WEIGHT_FILES if fetch_weights else [])),
        ("data.tokenizer", cfg.data, "tokenizer", TOKENIZER_FILES),
    ]
    for field, section, attr, patterns in targets:
        value = getattr(section, attr)
        if value is None or not is_hub_id(value):
            continue
        try:
            setattr(section, attr, resolve_hub_id(value, field, patterns))
        except ValueError as exc:
            problems.append(str(exc))
    return problems
