"""The training sections (``[train]``, ``[train.lora]``, ``[checkpoint]``, ``[logging]``) and the whole
:class:`TrainConfig`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from sft_trainer.config.errors import ConfigError
from sft_trainer.config.models import is_vision_language, resolve_model_config
from sft_trainer.config.presets import SHIPPED_DATA, SHIPPED_TOKENIZER, SHIPPED_VL_DATA, SHIPPED_VL_PROCESSOR
from sft_trainer.config.sections import DataConfig, ModelConfig, ParallelConfig, _Section


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


MAX_STEPS = 10**9
"""Above any run's step count: a larger count is a typo (a schedule over it would not decay)."""


class TrainingConfig(_Section):
    """``[train]``: steps, batch, optimizer (AdamW) and learning-rate schedule."""

    steps: int = Field(40, ge=1, le=MAX_STEPS, description="Optimizer steps to run (at most 10^9).")
    micro_batch_size: int = Field(
        1,
        ge=1,
        description="Packed rows per rank per micro-batch: must be 1 (a micro-batch is one packed row; more rows per step "
        "come from grad_accum or dp).",
    )
    grad_accum: int = Field(1, ge=1, le=MAX_STEPS, description="Micro-batches accumulated into each optimizer step.")
    lr: float = Field(3e-4, gt=0, le=1, description="Peak learning rate (AdamW moves a weight by up to lr a step).")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final learning rate as a fraction of `lr`.")
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS, description="Linear warmup steps (at most `steps`).")
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
        le=MAX_STEPS,
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
        None,
        min_length=1,
        description="Where training checkpoints go; unset: `output_dir`/checkpoints (see `checkpoint_dir`).",
    )
    every: int = Field(
        0, ge=0, le=MAX_STEPS, description="Save a checkpoint every this many steps (0: only at the end)."
    )
    resume: bool | str = Field(
        False,
        description="true (or 'latest'): resume from the latest checkpoint in `dir` (start fresh if none); a path: resume "
        "from that checkpoint (must exist); false: start fresh.",
    )
    allow_data_change: bool = Field(
        False,
        description="Resume even when the data's fingerprint (token store and pack plan keys) differs from the one the "
        "checkpoint records; the data position then points into other rows.",
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
    project: str = Field("cp-sft", min_length=1, description="wandb project name.")
    run_name: str | None = Field(None, min_length=1, description="wandb run name; default: wandb's generated one.")


class LoggingConfig(_Section):
    """``[logging]``: metrics and progress output (rank 0)."""

    log_every: int = Field(
        1,
        ge=1,
        le=MAX_STEPS,
        description="Print a plain progress line every this many steps (metrics.jsonl and wandb get every step).",
    )
    metrics_file: str | None = Field(
        None,
        min_length=1,
        description="JSONL file of per-step metrics; unset: `output_dir`/metrics.jsonl (see `metrics_path`).",
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
    output_dir: str = Field(
        "outputs", min_length=1, description="Run folder: checkpoints, metrics, the exported model."
    )

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
    def tokenizer_field(self) -> str:
        """How messages name :attr:`tokenizer_path`: the field the user set, or where it comes from."""
        if self.data.tokenizer:
            return f"data.tokenizer={self.data.tokenizer!r}"
        if self.model.path is not None:
            return f"the tokenizer of model.path={self.model.path!r}"
        return f"the shipped tokenizer {self.tokenizer_path!r}"

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
