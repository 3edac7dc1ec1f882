"""Whether a cp suits a model's heads."""

from __future__ import annotations

from sft_trainer.plan.parameters import _family


def attention_strategy(text_config, cp: int, attention_cp: str = "ulysses") -> str | None:
    """How the model's softmax attention splits over ``cp`` under ``attention_cp``: "ulysses", "kv_gather" or
    "kv_ring" (cp_core.resolve_attention_cp_style; raises its error when forced Ulysses cannot); None without attention."""
    from cp_core import resolve_attention_cp_style

    types = text_config.layers_block_type if _family(text_config) == "nemotron_h" else text_config.layer_types
    if "full_attention" not in types:
        return None
    return resolve_attention_cp_style(
        attention_cp, text_config.num_attention_heads, text_config.num_key_value_heads, cp
    )


def valid_cp(text_config, cp: int, mamba_cp_style: str = "state_passing", attention_cp: str = "ulysses") -> str | None:
    """None when the model's heads allow this cp, else the rule that forbids it (cp_core's message)."""
    from cp_core import ContextParallelError
    from cp_core.head_parallel import check_head_parallel

    family = _family(text_config)
    types = text_config.layers_block_type if family == "nemotron_h" else text_config.layer_types
    try:
        attention_strategy(text_config, cp, attention_cp)
        if family == "nemotron_h" and "linear_attention" in types and mamba_cp_style == "a2a":
            check_head_parallel(
                text_config.mamba_num_heads, text_config.n_groups, cp, what="Mamba-2 head-parallel (a2a) CP"
            )
    except ContextParallelError as exc:
        return str(exc)
    return None
