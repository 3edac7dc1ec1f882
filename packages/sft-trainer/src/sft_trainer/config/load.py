"""Reading a run's config: TOML, then overrides, then every rule, each problem in one :class:`ConfigError`."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from sft_trainer.config.errors import ConfigError
from sft_trainer.config.models import _check_model, _model_source, resolve_model_config
from sft_trainer.config.overrides import _apply_overrides, _submodel, _unknown_key, parse_overrides
from sft_trainer.config.presets import CONFIGS_DIR, DEFAULT_CONFIG
from sft_trainer.config.schema import TrainConfig
from sft_trainer.job_failure import one_line

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


def _format_validation_error(exc: ValidationError) -> list[str]:
    """One ``field=value: rule`` line per offending field (union branches merged)."""
    merged: dict[str, list[str]] = {}
    inputs: dict[str, Any] = {}
    for err in exc.errors():
        loc = err["loc"]
        if err["type"] == "extra_forbidden":
            merged.setdefault(_unknown_key([str(p) for p in loc[:-1]], str(loc[-1])), [])
            continue
        cls: type[BaseModel] | None = TrainConfig
        key = ""
        for item in loc:
            if isinstance(item, int):
                key += f"[{item}]"
            elif cls is not None and item in cls.model_fields:
                key = f"{key}.{item}" if key else item
                cls = _submodel(cls.model_fields[item].annotation)
            # anything else names a union branch or a validator: not part of the field's path
        key = key or "<config>"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            msg = "required"
        elif err["type"] in ("bool_type", "bool_parsing"):
            msg = "must be true or false"
        elif err["type"] == "finite_number":
            msg = "must be a finite number (inf and nan are refused)"
        elif err["type"] == "string_too_short":  # often "$VAR" with VAR unset
            msg = "must not be empty: give a value, or leave the key out for its default"
        merged.setdefault(key, [])
        if msg not in merged[key]:
            merged[key].append(msg)
        inputs.setdefault(key, err.get("input"))
    problems = []
    for key, msgs in merged.items():
        if not msgs:  # unknown key, already a whole sentence
            problems.append(key)
        elif key in inputs and msgs != ["required"]:
            problems.append(f"{key}={inputs[key]!r}: {', or '.join(msgs)}")
        else:
            problems.append(f"{key}: {', or '.join(msgs)}")
    return problems


def check_config(cfg: TrainConfig, weights: bool = True) -> list[str]:
    """Every cross-field and model-dependent problem of an already type-checked config (empty: valid);
    ``weights=False`` leaves out the check of ``model.path``'s weight files (a command that reads none)."""
    problems: list[str] = []
    par, data, train = cfg.parallel, cfg.data, cfg.train

    if data.seq_len % par.cp:
        problems.append(
            f"data.seq_len={data.seq_len} must be divisible by parallel.cp={par.cp} (each CP rank holds seq_len/cp "
            "tokens)"
        )
    if train.micro_batch_size != 1:
        problems.append(
            f"train.micro_batch_size={train.micro_batch_size} must be 1 (a micro-batch is one packed row; raise "
            "train.grad_accum or parallel.dp for more rows per step)"
        )
    if par.local_workers is not None:
        if par.local_workers % par.cp:
            problems.append(f"parallel.local_workers={par.local_workers} must be a multiple of parallel.cp={par.cp}")
        elif par.dp != -1 and par.local_workers != par.dp * par.cp:
            problems.append(
                f"parallel.local_workers={par.local_workers} must equal parallel.dp * parallel.cp = "
                f"{par.dp} * {par.cp} = {par.dp * par.cp} (or set parallel.dp = -1)"
            )
    if train.warmup_steps > train.steps:
        problems.append(
            f"train.warmup_steps={train.warmup_steps} must be <= train.steps={train.steps} (warmup happens within "
            "the run)"
        )
    if train.lora.enabled:
        if train.lora.rank <= 0:
            problems.append(f"train.lora.rank={train.lora.rank} must be > 0 when train.lora.enabled=true")
        if not train.lora.targets:
            problems.append("train.lora.targets=[]: must name at least one linear layer when train.lora.enabled=true")

    from sft_trainer.data.sources import file_type_problem, local_files_problem, needs_datasets

    for field_name, value, kind in (
        ("data.path", cfg.data_path, "file or folder"),
        ("data.tokenizer", cfg.tokenizer_path, "folder"),
    ):
        if field_name == "data.path" and (problem := file_type_problem(value)):
            problems.append(f"data.path={value!r}: {problem.removeprefix(f'{value}: ')}")
            continue
        if field_name == "data.path" and needs_datasets(value):
            continue  # a hub id or a glob: the data loader reports it in one line when it cannot be read
        if field_name == "data.tokenizer" and not data.tokenizer and cfg.model.path is not None:
            continue  # model.path's own tokenizer: a missing model.path is said once, by the model check
        if not Path(value).exists():
            problems.append(f"{field_name}={value!r}: no such {kind}")
        elif field_name == "data.path" and (problem := local_files_problem(value, data.messages_column)):
            problems.append(f"data.path={value!r}: {problem.removeprefix(f'{value}: ')}")
    if data.processor is not None:
        if not (Path(data.processor) / "preprocessor_config.json").is_file():
            problems.append(
                f"data.processor={data.processor!r}: not a folder holding an image processor's preprocessor_config.json"
            )
        if not cfg.vision_language:
            problems.append(
                f"data.processor={data.processor!r} is set but {_model_source(cfg.model)} is a text-only model; "
                "images need a Qwen3.5-VL model (model.preset = 'tiny-qwen3_5-vl', or a VL checkpoint)"
            )
    resume = cfg.checkpoint.resume
    if isinstance(resume, str) and not resume.strip():  # often "$CKPT" with CKPT unset: not a fresh start
        problems.append(
            f"checkpoint.resume={resume!r}: must not be empty: true (the latest checkpoint), false, or a checkpoint path"
        )
    elif isinstance(resume, str) and resume not in ("true", "latest") and not Path(resume).exists():
        problems.append(f"checkpoint.resume={resume!r}: no such checkpoint (use true to resume from the latest)")

    model_problems = _check_model(cfg)
    problems.extend(model_problems)
    if not model_problems:
        problems.extend(_check_tokenizer(cfg))
        if weights and cfg.model.path is not None:
            problems.extend(_weight_file_problems(cfg.model.path))
    return problems


def _weight_file_problems(path: str) -> list[str]:
    """The checkpoint's safetensors files are there (the workers read them; pickle weights never)."""
    from cp_models.hf_checkpoint import safetensors_files

    try:
        safetensors_files(path)
    except (OSError, ValueError) as exc:
        return [f"model.path={path!r}: {exc}"]
    return []


def _check_tokenizer(cfg: TrainConfig) -> list[str]:
    """The tokenizer a run renders and tokenizes with loads and has a chat template that compiles; for a
    checkpoint or config-file model it must fit the model too (presets take its vocabulary)."""
    from sft_trainer.data.render import chat_template_problem
    from sft_trainer.tokenizer_fit import (
        TOKENIZER_FILES,
        holds_tokenizer,
        load_tokenizer,
        tokenizer_file_problem,
        tokenizer_problems,
    )

    model = cfg.model
    folder = cfg.tokenizer_path
    if cfg.data.tokenizer is not None and Path(folder).is_dir() and not holds_tokenizer(folder):
        return [
            f"data.tokenizer={folder!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): name the folder "
            "a tokenizer was saved to (save_pretrained), or leave it unset (the checkpoint's tokenizer; a preset's shipped one)"
        ]
    preset = model.path is None and model.config is None
    if preset and cfg.data.tokenizer is None:
        return []  # the shipped tokenizer
    if cfg.data.tokenizer is None and model.path is not None and not holds_tokenizer(model.path):
        return [
            f"data.tokenizer is unset and model.path={model.path!r} holds no tokenizer (none of tokenizer.json, "
            "tokenizer_config.json): set data.tokenizer to the tokenizer made for this checkpoint"
        ]
    field = cfg.tokenizer_field
    if not Path(folder).is_dir():
        return []  # reported by check_config
    if broken := tokenizer_file_problem(folder):
        return [f"{field} does not load: {broken}"]
    try:
        tokenizer = load_tokenizer(folder)
    except Exception as exc:
        return [f"{field} does not load: {one_line(exc)}"]
    template = chat_template_problem(tokenizer)
    problems = [f"{field} {template}"] if template else []
    if not preset:
        own = cfg.data.tokenizer is None and model.path is not None
        problems += tokenizer_problems(tokenizer, resolve_model_config(model), field, _model_source(model), own)
    return problems


def config_from_dict(data: Mapping[str, Any], source: str | None = None, fetch_weights: bool = True) -> TrainConfig:
    """Validate a nested dict (as read from TOML) into a :class:`TrainConfig`, or raise :class:`ConfigError`.

    Hub ids in ``model.path`` and ``data.tokenizer`` are fetched (``sft_trainer.hub``) and replaced by their local
    snapshot folders first; ``fetch_weights=False`` fetches a model's config and tokenizer only."""
    from sft_trainer.hub import resolve_hub_ids

    try:
        cfg = TrainConfig.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc), source) from None
    problems = resolve_hub_ids(cfg, fetch_weights=fetch_weights)
    if problems:
        raise ConfigError(problems, source)
    problems = check_config(cfg, weights=fetch_weights)
    if problems:
        raise ConfigError(problems, source)
    return cfg


def _read_toml(path: Path) -> dict[str, Any]:
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a folder; --config names a TOML file")
    if not path.is_file():
        shipped = CONFIGS_DIR / f"{path.name}.toml" if path.suffix != ".toml" else CONFIGS_DIR / path.name
        if len(path.parts) == 1 and shipped.is_file():
            path = shipped
        else:
            shipped_names = ", ".join(sorted(p.stem for p in CONFIGS_DIR.glob("*.toml")))
            raise ConfigError(f"config file {str(path)!r} does not exist (shipped configs: {shipped_names})")
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); TOML files are UTF-8") from None


def load_config(
    path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = (), fetch_weights: bool = True
) -> TrainConfig:
    """Read a TOML config, apply command-line overrides and validate the result.

    ``path``: a TOML file, the name of a shipped config (``"tiny_cpu"``), or None: the schema defaults when the
    overrides name a checkpoint (``--model.path``), else the shipped ``configs/tiny_cpu.toml``. ``overrides``:
    ``["--parallel.cp", "2", "--train.steps=10", ...]``; values are parsed as TOML scalars (ints, floats,
    booleans, quoted or bare strings, arrays), ``null`` unsets an optional key. ``fetch_weights``: see
    :func:`config_from_dict`. Raises :class:`ConfigError` listing every problem (unknown keys name the valid ones).
    """
    data, source, problems = starting_data(path, overrides)
    if problems:
        raise ConfigError(problems, source)
    return config_from_dict(data, source, fetch_weights=fetch_weights)


def names_a_checkpoint(overrides: Sequence[str]) -> bool:
    """Whether command-line overrides set ``model.path`` (to anything but null)."""
    try:
        return any(key == "model.path" and value != "null" for key, value in parse_overrides(overrides))
    except ConfigError:
        return False


def starting_data(
    path: str | os.PathLike[str] | None, overrides: Sequence[str]
) -> tuple[dict[str, Any], str, list[str]]:
    """(the run's config as a nested dict, before validation; its source; override problems).

    A given ``path`` is read and the overrides applied on top. Without one, a command line naming a checkpoint
    (``--model.path``) starts from the schema defaults (cp 1, lr 3e-4, no warmup, ...): the shipped tiny run's
    settings are no starting point for a real model. Otherwise it starts from the shipped ``tiny_cpu.toml``."""
    if path is None and names_a_checkpoint(overrides):
        data: dict[str, Any] = {}
        source = "schema defaults + overrides"
    else:
        toml_path = DEFAULT_CONFIG if path is None else Path(path)
        data = _read_toml(toml_path)
        source = str(toml_path) + (" + overrides" if overrides else "")
    return data, source, _apply_overrides(data, overrides)
