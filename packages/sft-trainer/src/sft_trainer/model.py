"""The model a run trains: built from its config or loaded from ``model.path``, then parallelized."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from sft_trainer.config import TrainConfig, resolve_model_config
from sft_trainer.job_failure import one_line
from sft_trainer.parallelize import COMPUTE_DTYPES, parallelize_model

# VL config field -> the placeholder's name in sft_trainer.data.VisionTokens
VISION_TOKEN_FIELDS = {
    "image_token_id": "image_pad",
    "video_token_id": "video_pad",
    "vision_start_token_id": "vision_start",
    "vision_end_token_id": "vision_end",
}


class ModelLoadError(RuntimeError):
    """The model does not build or ``model.path`` does not load (missing, truncated or mis-shaped weights, weights
    holding inf or nan): alike on every rank."""


def vision_token_ids(tokenizer) -> dict[str, int]:
    """The ids of Qwen3.5-VL's vision placeholder tokens in ``tokenizer`` (config field -> id), those it has."""
    from sft_trainer.data import VisionTokens

    ids = VisionTokens().ids(tokenizer)
    return {field: ids[name] for field, name in VISION_TOKEN_FIELDS.items() if name in ids}


def check_vision_tokens(hf_config, tokenizer) -> None:
    """A VL model's placeholder ids must be the tokenizer's (else images would land on the wrong tokens)."""
    from sft_trainer.data import VisionTokens

    ids = vision_token_ids(tokenizer)
    wrong = [
        f"{field}={getattr(hf_config, field)} but the tokenizer's "
        f"{getattr(VisionTokens(), VISION_TOKEN_FIELDS[field])} is {ids.get(field, 'absent')}"
        for field in ("image_token_id", "vision_start_token_id")
        if ids.get(field) != getattr(hf_config, field)
    ]
    if wrong:
        raise SystemExit(f"sft-train: the tokenizer does not match the VL model: {'; '.join(wrong)}")


def create_model(cfg: TrainConfig, tokenizer) -> torch.nn.Module:
    """The plain model on the CPU in its storage dtype: fp32 master weights under FSDP (which casts the gathered
    parameters), else ``model.dtype``. Loaded from ``model.path``, else randomly initialized from the config file
    or the preset (the preset takes the tokenizer's vocabulary). Raises :class:`ModelLoadError`."""
    from cp_models.families import family_for

    storage_dtype = torch.float32 if cfg.parallel.fsdp else COMPUTE_DTYPES[cfg.model.dtype]
    hf_config = resolve_model_config(cfg.model, vocab_size=len(tokenizer), token_ids=vision_token_ids(tokenizer))
    family = family_for(hf_config)
    kwargs = dict(attention_backend=cfg.model.attention_backend, recurrent_backend=cfg.model.recurrent_backend)
    if family.cp_style_argument:  # the family's CP style goes to the model (Nemotron-H's Mamba-2 strategy)
        kwargs[family.cp_style_argument] = cfg.parallel.resolve_cp_style(family.name)
    if family.is_vision_language(hf_config):
        check_vision_tokens(hf_config, tokenizer)
        kwargs["vision_cp"] = cfg.model.vision_cp
    model_class = family.model_class_for(hf_config)
    if cfg.model.path:
        try:
            model = model_class.from_pretrained(cfg.model.path, dtype=storage_dtype, **kwargs)
        except Exception as exc:
            raise ModelLoadError(f"model.path={cfg.model.path!r} does not load: {one_line(exc)}") from None
        bad = [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
        if bad:  # every step would be skipped as non-finite, for a reason the run could not name
            raise ModelLoadError(
                f"model.path={cfg.model.path!r} holds inf or nan in {len(bad)} tensor(s) ({', '.join(bad[:3])}"
                f"{', ...' if len(bad) > 3 else ''}): train from a checkpoint whose weights are finite"
            )
        return model
    torch.manual_seed(cfg.train.seed)
    try:
        return model_class(hf_config, **kwargs).to(storage_dtype)
    except Exception as exc:  # e.g. sizes too large for this host's memory
        source = f"model.config={cfg.model.config!r}" if cfg.model.config else f"model.preset={cfg.model.preset!r}"
        raise ModelLoadError(f"{source} does not build a model: {one_line(exc)}") from None


def build_model(cfg: TrainConfig, tokenizer, mesh: DeviceMesh) -> torch.nn.Module:
    """The model, ready to train on ``mesh``: :func:`create_model`, then
    :func:`~sft_trainer.parallelize.parallelize_model`."""
    return parallelize_model(create_model(cfg, tokenizer), cfg, mesh)
