"""The trainer's configuration: pydantic models read from TOML, overridden from the command line, checked at load.

A run is described by one TOML file with torchtitan-like sections (``[model]``, ``[data]``, ``[parallel]``,
``[train]``, ``[train.lora]``, ``[checkpoint]``, ``[logging]``, ``[logging.wandb]``) and a top-level
``output_dir``. Command-line overrides address any key by its dotted path::

    sft-train --config run.toml --model.path /ckpt/Qwen3.5-0.8B --parallel.cp 2 --train.steps=10

:func:`load_config` validates everything before any process group or weight exists: types, enums, ranges and
unknown keys (pydantic), the rules that tie fields together (``seq_len`` divisible by ``cp``, one row per micro
batch under CP, warmup within the run, ...) and the rules that depend on the model's ``config.json`` (attention
heads vs ``cp`` for Ulysses, layer types vs the CP style, the GDN conv halo vs the shard length). Every problem
is reported as ``field=value: rule`` in one :class:`ConfigError`, identically on every rank.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = [
    "CONFIGS_DIR",
    "DEFAULT_CONFIG",
    "LAYER_CP_STYLES",
    "PRESETS",
    "SHIPPED_DATA",
    "SHIPPED_TOKENIZER",
    "SHIPPED_VL_DATA",
    "SHIPPED_VL_PROCESSOR",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "ParallelConfig",
    "TrainConfig",
    "TrainingConfig",
    "WandbConfig",
    "check_config",
    "config_from_dict",
    "load_config",
    "model_family",
    "parse_overrides",
    "resolve_model_config",
    "tiny_nemotron_h_config",
    "tiny_qwen35_config",
    "tiny_qwen35_vl_config",
]

_PACKAGE_DIR = Path(__file__).resolve().parent
CONFIGS_DIR = _PACKAGE_DIR / "configs"
DEFAULT_CONFIG = CONFIGS_DIR / "tiny_cpu.toml"
SHIPPED_DATA = _PACKAGE_DIR / "assets" / "tiny_chat.jsonl"
SHIPPED_TOKENIZER = _PACKAGE_DIR / "assets" / "tiny_tokenizer"
SHIPPED_VL_DATA = _PACKAGE_DIR / "assets" / "tiny_vl_chat" / "data.jsonl"
SHIPPED_VL_PROCESSOR = _PACKAGE_DIR / "assets" / "tiny_vl_processor"
# Public model shapes (config.json of the real models, no weights): `model.config = "qwen3_5-0.8b"` etc.
SHIPPED_MODEL_CONFIGS = CONFIGS_DIR / "models"

# Which CP styles each layer type runs under, per model family (``parallel.cp_style``; "auto" picks the first
# style of the family). Qwen3.5: "ulysses" = softmax attention by Ulysses all-to-all, GDN by the conv halo and
# state passing. Nemotron-H: the style is the Mamba-2 strategy ("state_passing": conv halo + SSD state passing;
# "a2a": head-parallel all-to-all); MLP/MoE layers need no CP. Softmax attention follows ``parallel.attention_cp``
# (Ulysses or all-gathered KV) under every style.
LAYER_CP_STYLES: dict[str, dict[str, tuple[str, ...]]] = {
    "qwen3_5": {"full_attention": ("ulysses",), "linear_attention": ("ulysses",)},
    "nemotron_h": {
        "linear_attention": ("state_passing", "a2a"),
        "full_attention": ("state_passing", "a2a"),
        "mlp": ("state_passing", "a2a"),
        "moe": ("state_passing", "a2a"),
    },
}
FAMILY_CP_STYLES = {"qwen3_5": ("ulysses",), "nemotron_h": ("state_passing", "a2a")}
# nn.Linear names that LoRA may target, per model family (not lm_head: the tiled loss reads its weight directly,
# and it is often tied to the embeddings).
LINEAR_NAMES: dict[str, tuple[str, ...]] = {
    "qwen3_5": (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "in_proj_qkv",
        "in_proj_z",
        "in_proj_b",
        "in_proj_a",
        "out_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "shared_expert_gate",
    ),
    "nemotron_h": ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj", "up_proj", "down_proj"),
}
QWEN35_LINEAR_NAMES = LINEAR_NAMES["qwen3_5"]
NEMOTRON_H_MODEL_TYPES = ("nemotron_h",)
_VL_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")


class ConfigError(ValueError):
    """An invalid training config; ``problems`` lists every problem found, each as ``field=value: rule``."""

    def __init__(self, problems: str | Sequence[str], source: str | None = None):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        where = f" ({source})" if source else ""
        if len(self.problems) == 1:
            message = f"invalid config{where}: {self.problems[0]}"
        else:
            listed = "\n".join(f"  - {p}" for p in self.problems)
            message = f"invalid config{where}, {len(self.problems)} problems:\n{listed}"
        super().__init__(message)


# ----------------------------------------------------------------------------------------------------------
# The tiny preset


def tiny_qwen35_config(vocab_size: int = 1024):
    """The built-in tiny hybrid Qwen3.5 (``model.preset = "tiny-qwen3_5"``): a transformers ``Qwen3_5TextConfig``.

    Four layers (three Gated DeltaNet, then one gated softmax attention), hidden size 64, 4 query / 2 KV heads
    of dim 16 (so cp in 1, 2, 4 satisfies Ulysses), GDN with 2 key / 4 value heads of dim 16 and conv kernel 4,
    tied embeddings. ``vocab_size`` is set from the tokenizer at run time.
    """
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )


def tiny_nemotron_h_config(vocab_size: int = 1024):
    """The built-in tiny Nemotron-H (``model.preset = "tiny-nemotron_h"``): a transformers ``NemotronHConfig``.

    Five layers "M*M-E" (Mamba-2, attention, Mamba-2, squared-ReLU MLP, MoE with 4 experts top-2 and a shared
    expert), hidden size 64; Mamba 8 heads of dim 8, 2 B/C groups, state 16, conv kernel 4 (a2a splits the groups
    at cp=2 and replicates them at cp=4 or 8); attention 4 query / 2 KV heads of dim 16.
    """
    from transformers import NemotronHConfig

    return NemotronHConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        hybrid_override_pattern="M*M-E",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        mamba_num_heads=8,
        mamba_head_dim=8,
        n_groups=2,
        ssm_state_size=16,
        conv_kernel=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32,
        max_position_embeddings=4096,
        layer_norm_epsilon=1e-5,
    )


def tiny_qwen35_vl_config(vocab_size: int = 1024, **token_ids: int):
    """The built-in tiny Qwen3.5-VL (``model.preset = "tiny-qwen3_5-vl"``): a transformers ``Qwen3_5Config``.

    The tiny hybrid text model of :func:`tiny_qwen35_config` (with tied embeddings, as Qwen3.5's small models) and a
    2-block vision tower: hidden 32, 2 heads, patch 8, temporal patch 2, spatial merge 2 (a 32 x 32 image gives 4
    text-side tokens), an 8 x 8 learned position grid, output width 64. ``vocab_size`` and the placeholder ids
    (``image_token_id``, ``video_token_id``, ``vision_start_token_id``, ``vision_end_token_id``; default: the last
    four ids) come from the tokenizer at run time.
    """
    from transformers import Qwen3_5Config

    text = tiny_qwen35_config(vocab_size).to_dict()
    fields = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
    defaults = {name: vocab_size - 4 + i for i, name in enumerate(fields)}
    return Qwen3_5Config(
        text_config=text,
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=text["hidden_size"],
            patch_size=8,
            temporal_patch_size=2,
            spatial_merge_size=2,
            num_position_embeddings=64,
        ),
        tie_word_embeddings=True,
        **{**defaults, **token_ids},
    )


PRESETS = {
    "tiny-qwen3_5": tiny_qwen35_config,
    "tiny-nemotron_h": tiny_nemotron_h_config,
    "tiny-qwen3_5-vl": tiny_qwen35_vl_config,
}


def is_vision_language(hf_config) -> bool:
    """Whether a transformers config is a Qwen3.5-VL one (a vision tower beside the text model)."""
    return hf_config.model_type in _VL_MODEL_TYPES and getattr(hf_config, "vision_config", None) is not None


def model_family(hf_config) -> str:
    """``"nemotron_h"`` or ``"qwen3_5"`` (text, MoE or VL) for a transformers config."""
    return "nemotron_h" if hf_config.model_type in NEMOTRON_H_MODEL_TYPES else "qwen3_5"


# ----------------------------------------------------------------------------------------------------------
# Sections


class _Section(BaseModel):
    # strict: TOML and the override parser give real ints, floats, bools and strings, so "10" for an int or 1
    # for a bool is a mistake to report, not a value to coerce (ints are still accepted for floats).
    # allow_inf_nan=False: every float must be finite (an infinite lr trained a model of NaNs and exited 0).
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class ModelConfig(_Section):
    """``[model]``: which model to train and how to run it."""

    path: str | None = Field(
        None,
        description="HF checkpoint folder (config.json + safetensors, usually with its tokenizer) to fine-tune: "
        "Qwen3.5 (dense, MoE or VL) or Nemotron-H; or a Hugging Face Hub id ('org/name', not a local path), fetched "
        "into the hub cache (config, safetensors and tokenizer files only; HF_HUB_OFFLINE=1 reads the cache only). "
        "Without --config, a run naming model.path starts from the schema defaults (what `--model.path X --help` "
        "shows), not from tiny_cpu.toml.",
    )
    config: str | None = Field(
        None,
        description="A config.json (or a folder holding one) to build a randomly initialized model from, or the "
        "name of a shipped public shape ('qwen3_5-0.8b', 'qwen3_5-2b', 'qwen3_5-35b-a3b', "
        "'nemotron_h-nano-30b-a3b'); exclusive with `path`.",
    )
    preset: Literal["tiny-qwen3_5", "tiny-nemotron_h", "tiny-qwen3_5-vl"] | None = Field(
        "tiny-qwen3_5",
        description="Built-in model config, used when neither `path` nor `config` is set: 'tiny-qwen3_5' is a "
        "4-layer hybrid (3 GDN + 1 attention), 'tiny-nemotron_h' a 5-layer Nemotron-H (Mamba-2, attention, MLP, "
        "MoE), 'tiny-qwen3_5-vl' the tiny hybrid with a 2-block Qwen3.5 vision tower; all take the vocabulary "
        "(and the VL one the image token ids) of the tokenizer.",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Compute dtype ('bfloat16' on GPUs, 'float32' for CPU runs). With parallel.fsdp the sharded "
        "master weights, gradient reduction and optimizer state stay float32 (mixed precision); without it the "
        "whole model is cast.",
    )
    attention_backend: Literal["auto", "torch", "varlen", "flash_attn"] = Field(
        "auto", description="Softmax attention kernel (cp_core.AttentionBackend); 'auto' picks the fastest available."
    )
    recurrent_backend: Literal["auto", "torch", "fla"] = Field(
        "auto",
        description="GDN conv/delta-rule kernels (cp_core.RecurrentBackend): 'fla' needs flash-linear-attention "
        "and CUDA; 'auto' uses it when available, else the torch reference.",
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute each decoder layer in backward instead of keeping its activations."
    )
    vision_cp: Literal["shard", "replicate"] = Field(
        "shard",
        description="VL models: how the CP ranks of a row share the vision tower. 'shard': each encodes a subset "
        "of the row's images balanced by patch count and the embeddings are all-gathered; 'replicate': every rank "
        "encodes every image. Same numbers; 'shard' divides the vision time and memory by up to cp.",
    )
    compile: bool = Field(
        False,
        description="torch.compile the collective-free parts of each decoder layer (norms, MLP/MoE, the token "
        "mixer's output norm); token mixers with all-to-alls and halos stay eager.",
    )


class DataConfig(_Section):
    """``[data]``: the chat dataset, its tokenizer and the packed rows."""

    path: str | None = Field(
        None,
        description="Chat dataset: a JSONL or Parquet file or folder of them, one {'messages': [...]} per row "
        "(message contents may mix text and image parts for VL models); with the datasets extra also a "
        "save_to_disk folder, a .json file or a glob of data files (read by load_dataset), or a Hugging Face Hub "
        "dataset id ('org/name'); unset: the shipped tiny set (text, or the tiny image set for a VL model).",
    )
    messages_column: str | None = Field(
        None,
        description="Column (key) holding each record's conversation; unset: 'messages', or 'conversations' when "
        "there is no 'messages'. ShareGPT turns ({'from': human|gpt|system, 'value': ...}) are converted to messages.",
    )
    split: str | None = Field(
        None, description="Split of a hub dataset or a save_to_disk DatasetDict folder; unset: 'train'."
    )
    subset: str | None = Field(None, description="Configuration (subset) of a hub dataset; unset: its default.")
    tokenizer: str | None = Field(
        None,
        description="Tokenizer folder (tokenizer.json with a chat template) or a Hugging Face Hub id ('org/name'); "
        "unset: model.path's own tokenizer for a "
        "checkpoint, else the shipped tiny tokenizer (the tiny VL processor's for a VL model). Its ids and special "
        "tokens must fit the model's vocabulary.",
    )
    processor: str | None = Field(
        None,
        description="Image processor folder (preprocessor_config.json of transformers' Qwen2-VL image processor) "
        "for datasets with images; unset: the tokenizer folder when it holds one.",
    )
    seq_len: int = Field(
        256,
        gt=0,
        le=2**24,
        description="Tokens per packed row (S, at most 2^24); each of the cp ranks holds seq_len / cp of them.",
    )
    overlong: Literal["truncate", "drop"] = Field(
        "truncate", description="A conversation longer than seq_len is truncated to seq_len, or dropped."
    )
    on_error: Literal["raise", "skip"] = Field(
        "raise", description="A malformed record stops the run ('raise') or is skipped and counted ('skip')."
    )
    seed: int = Field(0, ge=0, lt=2**63, description="Seed of the dataset shuffle and packing order.")
    image_paths_outside: bool = Field(
        False,
        description="Image paths in a data file resolve against its folder and must stay inside it (no absolute "
        "path, no '..' leading out); true allows any path the process can read.",
    )
    cache_dir: str | None = Field(
        None,
        description="Folder of the token cache: tokenized documents and pack plans on disk, keyed by the data files' "
        "content, tokenizer, template, processor and packing settings, and reused by later runs; unset: "
        "$SFT_TRAINER_CACHE, else ~/.cache/sft-trainer/data.",
    )
    num_proc: int = Field(
        0,
        ge=0,
        description="Processes that tokenize a dataset not yet in the cache (local rank 0 of each node runs them "
        "while the other ranks wait); 0 = every CPU core of the machine.",
    )


class ParallelConfig(_Section):
    """``[parallel]``: the dp x cp process layout."""

    dp: int = Field(
        1,
        description="Data-parallel replicas; -1 = all remaining ranks (world size / cp). Each replica packs its rows.",
    )
    cp: int = Field(1, ge=1, description="Context-parallel ranks per replica; each holds seq_len / cp tokens of a row.")
    cp_style: Literal["auto", "ulysses", "state_passing", "a2a"] = Field(
        "auto",
        description="CP strategy. Qwen3.5: 'ulysses' (all-to-all attention, conv halo + state passing for GDN). "
        "Nemotron-H, the strategy of its Mamba-2 layers: 'state_passing' (conv halo + SSD state passing, any cp) or "
        "'a2a' (head-parallel all-to-all, needs cp | Mamba heads). Softmax attention follows attention_cp under "
        "every style. 'auto': 'ulysses' for Qwen3.5, 'state_passing' for Nemotron-H.",
    )
    attention_cp: Literal["ulysses", "kv_gather", "kv_ring", "auto"] = Field(
        "ulysses",
        description="How softmax-attention layers split over cp: 'ulysses' (the default: all-to-all to head shards, "
        "even work per rank; cp must divide the query heads), 'kv_gather' (every rank all-gathers the row's keys and "
        "values; any cp), 'kv_ring' (the keys and values pass around the ring of ranks; any cp; per-rank memory "
        "that does not grow with the row, twice kv_gather's bytes in backward), 'auto': 'ulysses' where the heads "
        "allow it, else 'kv_gather' below cp 32 and 'kv_ring' from cp 32 (cp_core.AUTO_RING_FROM_CP).",
    )
    fsdp: bool = Field(
        True,
        description="Shard parameters, gradients and optimizer state with FSDP2 over all dp x cp ranks (gradients "
        "summed by reduce-scatter); false keeps a full replica per rank and all-reduces gradients.",
    )
    backend: Literal["gloo", "nccl", "auto"] = Field(
        "auto", description="torch.distributed backend; 'auto' = nccl when CUDA is available, else gloo."
    )
    collective_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="Process-group timeout: a rank waiting longer than this in a collective (another rank frozen, "
        "stuck or dead) stops the run with an error instead of waiting forever (NCCL: see docs/sft-trainer.md).",
    )
    heartbeat_timeout_s: float = Field(
        300.0,
        ge=0,
        description="A worker that has not answered for this long (stopped by a signal, or stuck in native code) "
        "is named and the run stopped: by the launcher, or under torchrun by the rank that sees it; 0 disables.",
    )
    local_workers: int | None = Field(
        None,
        ge=1,
        description="Processes to spawn on this machine when not launched by torchrun; default dp * cp "
        "(cp when dp = -1).",
    )

    @field_validator("dp")
    @classmethod
    def _dp_rule(cls, value: int) -> int:
        if value < 1 and value != -1:
            raise ValueError("must be >= 1, or -1 for all remaining ranks")
        return value

    def resolve_cp_style(self, family: str) -> str:
        """The CP style for a model family ("qwen3_5" or "nemotron_h"), resolving "auto"."""
        return FAMILY_CP_STYLES[family][0] if self.cp_style == "auto" else self.cp_style

    @property
    def num_local_workers(self) -> int:
        """How many processes to spawn locally (outside torchrun)."""
        if self.local_workers is not None:
            return self.local_workers
        return (self.dp if self.dp > 0 else 1) * self.cp

    def resolve_dp(self, world_size: int) -> int:
        """The dp size for ``world_size`` ranks (resolving -1); raises ConfigError unless dp * cp == world_size."""
        if world_size % self.cp:
            raise ConfigError(
                f"parallel.cp={self.cp} must divide the world size {world_size}: start a multiple of {self.cp} "
                "processes (torchrun --nproc-per-node, or parallel.local_workers), or lower parallel.cp"
            )
        dp = world_size // self.cp if self.dp == -1 else self.dp
        if dp * self.cp != world_size:
            raise ConfigError(
                f"parallel.dp={self.dp} x parallel.cp={self.cp} = {dp * self.cp} ranks, but the world size is "
                f"{world_size}; set dp = {world_size // self.cp} or -1"
            )
        return dp


class LoraConfig(_Section):
    """``[train.lora]``: low-rank adapters instead of full fine-tuning."""

    enabled: bool = Field(False, description="Train LoRA adapters on `targets` and freeze every other weight.")
    rank: int = Field(8, description="Adapter rank r (> 0 when enabled).")
    alpha: float = Field(16.0, gt=0, description="Adapter scale numerator: the update is (alpha / rank) * B A x.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter input.")
    targets: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "out_proj"],
        description="Names of the nn.Linear modules to adapt (matched on the last name component); a "
        "comma-separated string is accepted on the command line.",
    )

    @field_validator("targets", mode="before")
    @classmethod
    def _split_targets(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [name.strip() for name in value.split(",") if name.strip()]
        return value


class TrainingConfig(_Section):
    """``[train]``: steps, batch, optimizer (AdamW) and learning-rate schedule."""

    steps: int = Field(40, ge=1, description="Optimizer steps to run.")
    micro_batch_size: int = Field(
        1,
        ge=1,
        description="Packed rows per rank per micro-batch: must be 1 (a micro-batch is one packed row; more rows per step "
        "come from grad_accum or dp).",
    )
    grad_accum: int = Field(1, ge=1, description="Micro-batches accumulated into each optimizer step.")
    lr: float = Field(3e-4, gt=0, le=1, description="Peak learning rate (AdamW moves a weight by up to lr a step).")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final learning rate as a fraction of `lr`.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps (at most `steps`).")
    decay: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="Learning-rate decay after warmup, down to lr * min_lr_ratio."
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW (beta1, beta2), each in [0, 1).")
    max_grad_norm: float = Field(1.0, ge=0, description="Clip the global gradient norm to this; 0 disables clipping.")
    seed: int = Field(
        0,
        ge=0,
        lt=2**63,
        description="Seed of the weight init (random-init models), the LoRA adapters' init (the same on every rank) "
        "and LoRA dropout. The data order has its own seed, data.seed.",
    )
    max_nonfinite_steps: int = Field(
        3,
        ge=1,
        description="Stop with an error after this many consecutive steps whose loss or gradient norm is not "
        "finite (each such step is skipped on every rank).",
    )
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters ([train.lora]).")

    @field_validator("betas", mode="before")
    @classmethod
    def _betas_tuple(cls, value: Any) -> Any:
        return tuple(value) if isinstance(value, list) else value

    @field_validator("betas")
    @classmethod
    def _betas_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in value):
            raise ValueError("each beta must be in [0, 1)")
        return value


class CheckpointConfig(_Section):
    """``[checkpoint]``: saving, resuming and exporting."""

    dir: str | None = Field(
        None, description="Where training checkpoints go; unset: `output_dir`/checkpoints (see `checkpoint_dir`)."
    )
    every: int = Field(0, ge=0, description="Save a checkpoint every this many steps (0: only at the end).")
    resume: bool | str = Field(
        False,
        description="true (or 'latest'): resume from the latest checkpoint in `dir` (start fresh if none); a path: resume "
        "from that checkpoint (must exist); false: start fresh.",
    )
    export_hf: bool = Field(True, description="At the end, write an HF checkpoint folder under `output_dir`/hf.")
    merge_lora: bool = Field(
        True, description="With LoRA, merge the adapters into the exported weights (else export adapters separately)."
    )


class WandbConfig(_Section):
    """``[logging.wandb]``: Weights & Biases logging from rank 0."""

    enabled: bool = Field(False, description="Log metrics to wandb (needs the wandb package).")
    mode: Literal["offline", "online"] = Field(
        "offline", description="'offline' writes runs locally (sync later); 'online' streams them."
    )
    project: str = Field("cp-sft", description="wandb project name.")
    run_name: str | None = Field(None, description="wandb run name; default: wandb's generated one.")


class LoggingConfig(_Section):
    """``[logging]``: metrics and progress output (rank 0)."""

    log_every: int = Field(
        1,
        ge=1,
        description="Print a plain progress line every this many steps (metrics.jsonl and wandb get every step).",
    )
    metrics_file: str | None = Field(
        None, description="JSONL file of per-step metrics; unset: `output_dir`/metrics.jsonl (see `metrics_path`)."
    )
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="wandb logging ([logging.wandb]).")
    progress_bar: bool = Field(
        True,
        description="Rank 0 draws a progress bar (step/total, elapsed, ETA, loss, lr, tokens/s, memory) when stdout "
        "is a terminal; false, or stdout not a terminal (logs, CI): one plain line every log_every steps.",
    )


class TrainConfig(_Section):
    """A whole training run: the sections above plus ``output_dir``."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="Model ([model]).")
    data: DataConfig = Field(default_factory=DataConfig, description="Dataset and packing ([data]).")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="Process layout ([parallel]).")
    train: TrainingConfig = Field(default_factory=TrainingConfig, description="Optimization ([train]).")
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Checkpointing and export ([checkpoint])."
    )
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Metrics and logs ([logging]).")
    output_dir: str = Field("outputs", description="Run folder: checkpoints, metrics, the exported model.")

    @property
    def vision_language(self) -> bool:
        """Whether the model is a vision-language one (its config has a vision tower); False if it cannot be read."""
        try:
            return is_vision_language(resolve_model_config(self.model))
        except ConfigError:
            return False

    @property
    def data_path(self) -> str:
        """``data.path``, or the shipped tiny dataset (the image one for a VL model)."""
        return self.data.path or str(SHIPPED_VL_DATA if self.vision_language else SHIPPED_DATA)

    @property
    def tokenizer_path(self) -> str:
        """``data.tokenizer``; else the checkpoint folder ``model.path`` (its own tokenizer); else the shipped tiny
        tokenizer (the tiny VL processor's for a VL model)."""
        if self.data.tokenizer:
            return self.data.tokenizer
        if self.model.path is not None:
            return self.model.path
        return str(SHIPPED_VL_PROCESSOR if self.vision_language else SHIPPED_TOKENIZER)

    @property
    def processor_path(self) -> str | None:
        """``data.processor``, or the tokenizer folder when it holds an image processor config, else None."""
        if self.data.processor:
            return self.data.processor
        folder = Path(self.tokenizer_path)
        return str(folder) if (folder / "preprocessor_config.json").is_file() else None

    @property
    def checkpoint_dir(self) -> Path:
        """``checkpoint.dir``, or ``output_dir``/checkpoints when unset."""
        return Path(self.checkpoint.dir) if self.checkpoint.dir else Path(self.output_dir) / "checkpoints"

    @property
    def metrics_path(self) -> Path:
        """``logging.metrics_file``, or ``output_dir``/metrics.jsonl when unset."""
        return Path(self.logging.metrics_file) if self.logging.metrics_file else Path(self.output_dir) / "metrics.jsonl"


# ----------------------------------------------------------------------------------------------------------
# Schema helpers


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


# ----------------------------------------------------------------------------------------------------------
# Help


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return "|".join(json.dumps(a) if isinstance(a, str) else str(a) for a in typing.get_args(annotation))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation)).replace("typing.", "")


def wants_help(argv: Sequence[str]) -> bool:
    """Whether a command line asks for help: ``help`` first, or ``-h`` / ``--help`` anywhere."""
    return list(argv[:1]) == ["help"] or any(a in ("-h", "--help") for a in argv)


def config_help(command: str, about: str = "", argv: Sequence[str] = ()) -> str:
    """The usage of ``command`` and every config key: its dotted name, type, the value a run with the rest of the
    command line ``argv`` gets (its --config and overrides; unknown options are ignored here), and its description."""
    from sft_trainer.plan import split_config_argument

    shipped = ", ".join(sorted(p.stem for p in CONFIGS_DIR.glob("*.toml")))
    try:
        path, overrides = split_config_argument([a for a in argv if a not in ("help", "-h", "--help")])
        data, source, _ = starting_data(path, overrides)
    except ConfigError:
        data, source = {}, "schema defaults (the config file could not be read)"
    lines = [
        f"usage: {command} [--config FILE.toml] [--section.key VALUE ...]",
        "",
        *([about, ""] if about else []),
        f"--config names a TOML file or a shipped config ({shipped}). Without it, a command line naming a",
        "checkpoint (--model.path) starts from the schema defaults, any other from tiny_cpu. Every key below can be",
        "set there or overridden here, as --section.key VALUE or --section.key=VALUE (TOML values: 3, 1e-4, true,",
        "'text', [1, 2]); true/false keys may stand alone (--train.lora.enabled). The values shown are the ones",
        f"this command line gets ({source}). Docs: docs/sft-trainer.md.",
    ]

    def walk(cls: type[BaseModel], prefix: str, given: Mapping[str, Any]) -> None:
        fields = cls.model_fields.items()
        for name, field in fields:  # a section's own keys first, then its subsections, so none sits under another
            if _submodel(field.annotation) is None:
                value = given[name] if name in given else field.get_default(call_default_factory=True)
                shown = json.dumps(list(value) if isinstance(value, tuple) else value, default=str)
                lines.append(f"  --{prefix}{name} ({_type_name(field.annotation)}, value {shown})")
                if field.description:
                    lines.append(f"      {field.description}")
        for name, field in fields:
            sub = _submodel(field.annotation)
            if sub is not None:
                lines.extend(["", f"[{prefix}{name}] {field.description or ''}".rstrip()])
                section = given.get(name)
                walk(sub, f"{prefix}{name}.", section if isinstance(section, Mapping) else {})

    walk(TrainConfig, "", data)
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# Command-line overrides


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


# ----------------------------------------------------------------------------------------------------------
# Model-dependent checks


def _model_source(model: ModelConfig) -> str:
    if model.path is not None:
        return f"model.path={model.path!r}"
    if model.config is not None:
        return f"model.config={model.config!r}"
    return f"model.preset={model.preset!r}"


def resolve_model_config(model: ModelConfig, vocab_size: int | None = None, token_ids: Mapping[str, int] | None = None):
    """The transformers config ``model`` names: the checkpoint's, the config file's, or the preset's.

    A VL (``qwen3_5``) config is returned whole; use ``cp_models.load_text_config`` for its text part.
    ``vocab_size`` sets the preset's vocabulary and ``token_ids`` the VL preset's placeholder ids (checkpoints and
    config files keep their own).
    Raises :class:`ConfigError` naming the field when the file is missing, unreadable or of an unsupported
    model type.
    """
    from cp_models.qwen3_5 import SUPPORTED_MODEL_TYPES as QWEN35_MODEL_TYPES

    supported_types = (*QWEN35_MODEL_TYPES, *NEMOTRON_H_MODEL_TYPES)
    source = _model_source(model)
    if model.path is not None and model.config is not None:
        raise ConfigError(
            f"model.path={model.path!r} and model.config={model.config!r}: set one (a checkpoint to fine-tune, "
            "or a config.json for a randomly initialized model), not both"
        )
    if model.path is None and model.config is None:
        if model.preset is None:
            raise ConfigError("model: set one of model.path, model.config or model.preset")
        kwargs = {} if vocab_size is None else {"vocab_size": vocab_size}
        if model.preset.endswith("-vl") and token_ids:
            kwargs.update(token_ids)
        return PRESETS[model.preset](**kwargs)

    given = Path(model.path if model.path is not None else model.config)
    if model.path is None and not given.exists() and (SHIPPED_MODEL_CONFIGS / f"{model.config}.json").is_file():
        given = SHIPPED_MODEL_CONFIGS / f"{model.config}.json"  # a shipped shape, by name
    file = given / "config.json" if given.is_dir() else given
    if model.path is not None and not given.is_dir():
        raise ConfigError(f"{source}: not a folder; model.path is an HF checkpoint folder with a config.json")
    if not file.is_file():
        shapes = ", ".join(sorted(f.stem for f in SHIPPED_MODEL_CONFIGS.glob("*.json")))
        hint = f" (shipped model.config shapes: {shapes})" if model.path is None else ""
        raise ConfigError(f"{source}: {file} does not exist{hint}")
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{source}: cannot read {file} as JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {file} is not a JSON object")
    model_type = raw.get("model_type")
    if model_type not in supported_types:
        raise ConfigError(
            f"{source}: model_type={model_type!r} is not supported; supported model types: "
            f"{', '.join(sorted(supported_types))}"
        )
    from transformers import AutoConfig

    # Read by transformers itself, as from_pretrained will: it decodes what it writes (e.g. an infinite
    # time_step_limit as {"__float__": "Infinity"}). Never remote code: the model type is one of ours.
    try:
        return AutoConfig.from_pretrained(str(file), trust_remote_code=False)
    except Exception as exc:  # transformers' own validation of the config's values
        raise ConfigError(f"{source}: transformers rejects {file}: {exc}") from exc


def _check_model(cfg: TrainConfig) -> list[str]:
    from cp_core import ContextParallelError, resolve_attention_cp_style

    try:
        hf = resolve_model_config(cfg.model)
    except ConfigError as exc:
        return exc.problems
    source = _model_source(cfg.model)
    par, problems = cfg.parallel, []
    family = model_family(hf)
    style = par.resolve_cp_style(family)

    is_vl = is_vision_language(hf)
    if is_vl and style != "ulysses":
        problems.append(
            f"parallel.cp_style={par.cp_style!r}: {source} is a vision-language config (model_type "
            f"{hf.model_type!r}, has vision_config), which requires cp_style='ulysses'"
        )
    if family == "nemotron_h":
        text = hf
        layer_types = list(text.layers_block_type)
        conv_width, conv_name = text.conv_kernel, "Mamba conv_kernel"
    else:
        from cp_models import load_text_config

        text = load_text_config(hf)
        layer_types = list(text.layer_types[: text.num_hidden_layers])
        conv_width, conv_name = text.linear_conv_kernel_dim, "GDN conv halo needs linear_conv_kernel_dim"

    layers: dict[str, list[int]] = {}
    for i, layer_type in enumerate(layer_types):
        layers.setdefault(layer_type, []).append(i)
    supported = LAYER_CP_STYLES[family]
    unstyled = []
    for layer_type, idx in layers.items():
        styles = supported.get(layer_type)
        if styles is None:
            problems.append(
                f"{source}: layer type {layer_type!r} (layers {idx}) is not supported; supported layer types: "
                f"{', '.join(supported)}"
            )
        elif style not in styles:
            unstyled.append(f"{layer_type!r} (layers {idx}; runs under cp_style {' or '.join(map(repr, styles))})")
    if unstyled:
        problems.append(
            f"parallel.cp_style={par.cp_style!r} does not support the layer types of {source} "
            f"({hf.model_type}): {', '.join(unstyled)}"
        )

    if "full_attention" in layers:
        q, kv = text.num_attention_heads, text.num_key_value_heads
        try:
            resolve_attention_cp_style(par.attention_cp, q, kv, par.cp)
        except ContextParallelError as exc:
            problems.append(
                f"parallel.cp={par.cp} with parallel.attention_cp={par.attention_cp!r} vs the attention heads of "
                f"{source} (num_attention_heads={q}, num_key_value_heads={kv}): {exc}"
            )
    if family == "qwen3_5" and "linear_attention" in layers:
        k_heads, v_heads = text.linear_num_key_heads, text.linear_num_value_heads
        if v_heads % k_heads:
            problems.append(
                f"{source}: linear_num_value_heads={v_heads} must be a multiple of linear_num_key_heads={k_heads}"
            )
    if family == "nemotron_h" and "linear_attention" in layers and style == "a2a":
        from cp_core.head_parallel import check_head_parallel

        heads, groups = text.mamba_num_heads, text.n_groups
        try:
            check_head_parallel(heads, groups, par.cp, what="Mamba-2 head-parallel (a2a) CP")
        except ContextParallelError as exc:
            problems.append(
                f"parallel.cp={par.cp} with parallel.cp_style='a2a' vs the Mamba heads of {source} "
                f"(mamba_num_heads={heads}, n_groups={groups}): {exc}; or use cp_style='state_passing' (any cp)"
            )
    if "linear_attention" in layers and not (family == "nemotron_h" and style == "a2a"):
        halo = conv_width - 1
        if par.cp > 1 and cfg.data.seq_len // par.cp < halo:
            problems.append(
                f"data.seq_len={cfg.data.seq_len} is too short for parallel.cp={par.cp}: each CP shard holds "
                f"seq_len/cp={cfg.data.seq_len // par.cp} tokens but the {conv_name}-1={halo} "
                f"(seq_len >= cp * {halo} = {par.cp * halo})"
            )

    lora = cfg.train.lora
    if lora.enabled:
        names = LINEAR_NAMES[family]
        unknown = [t for t in lora.targets if t not in names]
        if unknown:
            problems.append(
                f"train.lora.targets={lora.targets!r}: {unknown} are not linear layers of {source}; choose from "
                f"{', '.join(names)}"
            )
    return problems


# ----------------------------------------------------------------------------------------------------------
# Checks and loading


def check_config(cfg: TrainConfig) -> list[str]:
    """Every cross-field and model-dependent problem of an already type-checked config (empty: valid)."""
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

    from sft_trainer.data_sources import needs_datasets

    for field_name, value, kind in (
        ("data.path", cfg.data_path, "file or folder"),
        ("data.tokenizer", cfg.tokenizer_path, "folder"),
    ):
        if field_name == "data.path" and needs_datasets(value):
            continue  # a hub id or a glob: the data loader reports it in one line when it cannot be read
        if not Path(value).exists():
            problems.append(f"{field_name}={value!r}: no such {kind}")
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
    if isinstance(resume, str) and resume not in ("true", "latest") and not Path(resume).exists():
        problems.append(f"checkpoint.resume={resume!r}: no such checkpoint (use true to resume from the latest)")

    model_problems = _check_model(cfg)
    problems.extend(model_problems)
    if not model_problems:
        problems.extend(_check_tokenizer(cfg))
    return problems


def _check_tokenizer(cfg: TrainConfig) -> list[str]:
    """The tokenizer a checkpoint or config-file model trains with must fit it (presets take its vocabulary)."""
    from sft_trainer.tokenizer_fit import holds_tokenizer, load_tokenizer, tokenizer_problems

    model = cfg.model
    if model.path is None and model.config is None:
        return []
    folder = cfg.tokenizer_path
    if cfg.data.tokenizer is None and model.path is not None:
        if not holds_tokenizer(model.path):
            return [
                f"data.tokenizer is unset and model.path={model.path!r} holds no tokenizer (none of tokenizer.json, "
                "tokenizer_config.json): set data.tokenizer to the tokenizer made for this checkpoint"
            ]
        field = f"the tokenizer of model.path={folder!r}"
    else:
        field = f"data.tokenizer={folder!r}"
    if not Path(folder).is_dir():
        return []  # reported by check_config
    try:
        tokenizer = load_tokenizer(folder)
    except Exception as exc:
        return [f"{field} does not load: {type(exc).__name__}: {exc}"]
    return tokenizer_problems(tokenizer, resolve_model_config(model), field, _model_source(model))


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
    problems = check_config(cfg)
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
