"""The ``[model]``, ``[data]`` and ``[parallel]`` sections of a run's config."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sft_trainer.config.errors import ConfigError
from sft_trainer.config.models import FAMILY_CP_STYLES


class _Section(BaseModel):
    # strict: TOML and the override parser give real ints, floats, bools and strings, so "10" for an int or 1
    # for a bool is a mistake to report, not a value to coerce (ints are still accepted for floats).
    # allow_inf_nan=False: every float must be finite (an infinite lr trained a model of NaNs and exited 0).
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class ModelConfig(_Section):
    """``[model]``: which model to train and how to run it."""

    path: str | None = Field(
        None,
        min_length=1,
        description="HF checkpoint folder (config.json + safetensors, usually with its tokenizer) to fine-tune: "
        "Qwen3.5 (dense, MoE or VL) or Nemotron-H; or a Hugging Face Hub id ('org/name', not a local path), fetched "
        "into the hub cache (config, safetensors and tokenizer files only; HF_HUB_OFFLINE=1 reads the cache only). "
        "Without --config, a run naming model.path starts from the schema defaults (what `--model.path X --help` "
        "shows), not from tiny_cpu.toml.",
    )
    config: str | None = Field(
        None,
        min_length=1,
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
    recurrent_backend: Literal["auto", "torch", "fla", "mamba_ssm"] = Field(
        "auto",
        description="Conv, GDN, SSD and gated-norm kernels (cp_core.RecurrentBackend): 'fla' needs "
        "flash-linear-attention and CUDA; 'mamba_ssm' runs Mamba-2's conv and SSD on causal-conv1d and mamba-ssm "
        "(the other ops as 'auto'); 'auto' picks per op the fastest installed, else the torch reference.",
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
        min_length=1,
        description="Chat dataset: a JSONL or Parquet file or folder of them, one {'messages': [...]} per row "
        "(message contents may mix text and image parts for VL models); with the datasets extra also a "
        "save_to_disk folder, a .json file or a glob of data files (read by load_dataset), or a Hugging Face Hub "
        "dataset id ('org/name'); unset: the shipped tiny set (text, or the tiny image set for a VL model).",
    )
    messages_column: str | None = Field(
        None,
        min_length=1,
        description="Column (key) holding each record's conversation; unset: 'messages', or 'conversations' when "
        "there is no 'messages'. ShareGPT turns ({'from': human|gpt|system, 'value': ...}) are converted to messages.",
    )
    split: str | None = Field(
        None, min_length=1, description="Split of a hub dataset or a save_to_disk DatasetDict folder; unset: 'train'."
    )
    subset: str | None = Field(
        None, min_length=1, description="Configuration (subset) of a hub dataset; unset: its default."
    )
    tokenizer: str | None = Field(
        None,
        min_length=1,
        description="Tokenizer folder (tokenizer.json with a chat template) or a Hugging Face Hub id ('org/name'); "
        "unset: model.path's own tokenizer for a "
        "checkpoint, else the shipped tiny tokenizer (the tiny VL processor's for a VL model). Its ids and special "
        "tokens must fit the model's vocabulary.",
    )
    processor: str | None = Field(
        None,
        min_length=1,
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
        min_length=1,
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

    def world_layout(self) -> tuple[int, int]:
        """(dp, cp) of this run's world: torchrun's WORLD_SIZE, else the local worker count (dp = -1 takes the rest).
        Raises ConfigError when they do not fit."""
        world = int(os.environ.get("WORLD_SIZE", 0)) or self.num_local_workers
        return self.resolve_dp(world), self.cp

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
