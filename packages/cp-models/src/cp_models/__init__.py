"""cp_models: Qwen3.5 (dense, MoE) and Nemotron-H with context parallelism, HF-checkpoint compatible."""

from cp_models.common import (
    CausalLMOutput,
    ContextParallelAttention,
    ContextParallelModule,
    apply_activation_checkpointing,
    set_context_parallel_attributes,
    token_log_probs,
)
from cp_models.nemotron_h import MambaCPStyle, NemotronHForCausalLM, load_nemotron_h_config
from cp_models.qwen3_5 import Qwen35ForCausalLM, load_text_config

__version__ = "0.1.0"

__all__ = [
    "CausalLMOutput",
    "ContextParallelAttention",
    "ContextParallelModule",
    "MambaCPStyle",
    "NemotronHForCausalLM",
    "Qwen35ForCausalLM",
    "apply_activation_checkpointing",
    "load_nemotron_h_config",
    "load_text_config",
    "set_context_parallel_attributes",
    "token_log_probs",
]
