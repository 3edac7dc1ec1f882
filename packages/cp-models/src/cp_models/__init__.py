"""cp_models: Qwen3.5 (dense, MoE) and Nemotron-H with context parallelism, HF-checkpoint compatible."""

from cp_models.activation_checkpointing import apply_activation_checkpointing
from cp_models.context_parallel import (
    ContextParallelAttention,
    ContextParallelModule,
    set_context_parallel_attributes,
)
from cp_models.families import FAMILIES, ModelFamily, family_for
from cp_models.loss import CausalLMOutput, token_log_probs
from cp_models.nemotron_h import NemotronHForCausalLM, load_nemotron_h_config
from cp_models.nemotron_h_mamba import MambaCPStyle
from cp_models.qwen3_5 import Qwen35ForCausalLM, load_text_config

__version__ = "0.1.0"

__all__ = [
    "FAMILIES",
    "CausalLMOutput",
    "ContextParallelAttention",
    "ContextParallelModule",
    "MambaCPStyle",
    "ModelFamily",
    "NemotronHForCausalLM",
    "Qwen35ForCausalLM",
    "apply_activation_checkpointing",
    "family_for",
    "load_nemotron_h_config",
    "load_text_config",
    "set_context_parallel_attributes",
    "token_log_probs",
]
