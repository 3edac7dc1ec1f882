"""Command-line overrides (``--section.key VALUE``) applied to the TOML data, key by key against the schema."""

from __future__ import annotations

import datetime
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any, Literal, Union

from pydantic import BaseModel

from sft_trainer.config.errors import ConfigError
from sft_trainer.config.schema import TrainConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


def _submodel(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _section_name(parts: Sequence[str]) -> str:
    return f"[{'.'.join(parts)}]" if parts else "the top level"


def _section_at(parts: Sequence[str]) -> type[BaseModel] | None:
    cls: type[BaseModel] | None = TrainConfig
    for part in parts:
        field = cls.model_fields.get(part) if cls else None
        cls = _submodel(field.annotation) if field else None
    return cls


def _unknown_key(parts: Sequence[str], key: str) -> str:
    cls = _section_at(parts)
    valid = ", ".join(cls.model_fields) if cls else "?"
    dotted = ".".join([*parts, key])
    return f"unknown key '{dotted}'; valid keys in {_section_name(parts)}: {valid}"


def _accepted_types(annotation: Any) -> set[type]:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return {type(a) for a in typing.get_args(annotation)}
    if origin in (Union, types.UnionType):
        return set().union(*(_accepted_types(a) for a in typing.get_args(annotation)))
    if origin is not None:
        return {origin}
    if annotation is None or annotation is type(None):
        return {type(None)}
    return {annotation} if isinstance(annotation, type) else set()


def _parse_value(raw: str, annotation: Any) -> Any:
    """A TOML scalar (or array / inline table) when ``raw`` parses as one, else the string itself."""
    if raw == "null":
        return None
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw
    if isinstance(value, (datetime.date, datetime.time)):
        return raw
    accepted = _accepted_types(annotation)
    fits = type(value) in accepted or (type(value) is int and float in accepted)
    if str in accepted and not fits:  # e.g. a run name "123" or a path "2024"
        return raw
    return value


def parse_overrides(overrides: Sequence[str]) -> list[tuple[str, str]]:
    """``["--a.b", "1", "--c=x", "--flag"]`` -> ``[("a.b", "1"), ("c", "x"), ("flag", "true")]`` (raw values).

    ``--key VALUE`` and ``--key=VALUE`` both work; a ``--key`` followed by another ``--option`` (or nothing) means
    ``true``. Dashes in key names are read as underscores (``--train.grad-accum``).
    """
    return [(key, value) for key, value, _bare in _parse_overrides_marked(overrides)]


def _parse_overrides_marked(overrides: Sequence[str]) -> list[tuple[str, str, bool]]:
    """:func:`parse_overrides`, each pair marked True when its key stood alone (read as ``true``)."""
    pairs: list[tuple[str, str, bool]] = []
    tokens = list(overrides)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--") or token == "--":
            raise ConfigError(f"unexpected argument {token!r}; overrides look like --section.key VALUE or --key=VALUE")
        body = token[2:]
        bare = False
        if "=" in body:
            key, value = body.split("=", 1)
            i += 1
        elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            key, value = body, tokens[i + 1]
            i += 2
        else:
            key, value, bare = body, "true", True
            i += 1
        pairs.append((key.replace("-", "_"), value, bare))
    return pairs


def _apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> list[str]:
    problems: list[str] = []
    for key, raw, bare in _parse_overrides_marked(overrides):
        parts = key.split(".")
        if not all(parts):
            problems.append(f"bad override key {key!r}; write --section.key VALUE")
            continue
        if "\n" in raw or "\r" in raw:
            problems.append(f"--{key}={raw!r}: a value must be one line (it holds a line break)")
            continue
        cls: type[BaseModel] = TrainConfig
        node = data
        for depth, part in enumerate(parts):
            field = cls.model_fields.get(part)
            if field is None:
                problems.append(_unknown_key(parts[:depth], part))
                break
            sub = _submodel(field.annotation)
            last = depth == len(parts) - 1
            if last:
                value = _parse_value(raw, field.annotation)
                if bare and sub is None and bool not in _accepted_types(field.annotation):
                    problems.append(f"--{key} needs a value: --{key} VALUE (only true/false keys may stand alone)")
                elif sub is not None and not isinstance(value, dict):
                    problems.append(
                        f"'{key}' is a section, not a value; set one of its keys: {', '.join(sub.model_fields)}"
                    )
                elif sub is not None and isinstance(node.get(part), dict):
                    node[part] = {**node[part], **value}
                else:
                    node[part] = value
            elif sub is None:
                problems.append(f"'{'.'.join(parts[: depth + 1])}' is a value, not a section; cannot set '{key}'")
                break
            else:
                child = node.get(part)
                if not isinstance(child, dict):
                    child = node[part] = {}
                node, cls = child, sub
    return problems
