"""The tiny built-in model configs: hybrid models small enough to run forward and backward on CPU in a test.

Each returns a transformers config; keyword overrides replace the preset's values, so a test states only what it
changes. The trainer's ``model.preset`` names them (see :data:`cp_models.families.FAMILIES`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TINY_QWEN35: dict[str, Any] = dict(
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
"""Four layers (three Gated DeltaNet, then one gated softmax attention), hidden size 64, 4 query / 2 KV heads of
dim 16 (so cp in 1, 2, 4 satisfies Ulysses), GDN with 2 key / 4 value heads of dim 16 and conv kernel 4, tied
embeddings."""

TINY_QWEN35_MOE: dict[str, Any] = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24
)
"""What the MoE variant adds: 4 experts, top-2, a gated shared expert."""

TINY_NEMOTRON_H: dict[str, Any] = dict(
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
"""Five layers "M*M-E" (Mamba-2, attention, Mamba-2, squared-ReLU MLP, MoE with 4 experts top-2 and a shared
expert), hidden size 64; Mamba 8 heads of dim 8, 2 B/C groups, state 16, conv kernel 4 (a2a splits the groups at
cp=2 and replicates them at cp=4 or 8); attention 4 query / 2 KV heads of dim 16."""

TINY_VISION: dict[str, Any] = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=8,
    temporal_patch_size=2,
    spatial_merge_size=2,
    num_position_embeddings=64,
)
"""A 2-block Qwen3.5 vision tower: hidden 32, 2 heads, patch 8, temporal patch 2, spatial merge 2 (a 32 x 32 image
gives 4 text-side tokens), an 8 x 8 learned position grid; its output width is the text model's hidden size."""

VISION_TOKEN_FIELDS = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")


def tiny_qwen35_config(vocab_size: int = 1024, **overrides: Any):
    """The tiny hybrid Qwen3.5 (:data:`TINY_QWEN35`) as a transformers ``Qwen3_5TextConfig``."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**{**TINY_QWEN35, "vocab_size": vocab_size, **overrides})


def tiny_qwen35_moe_config(vocab_size: int = 1024, **overrides: Any):
    """The tiny hybrid Qwen3.5 with sparse MoE feed-forwards (:data:`TINY_QWEN35_MOE`), a ``Qwen3_5MoeTextConfig``."""
    from transformers import Qwen3_5MoeTextConfig

    dense = {k: v for k, v in TINY_QWEN35.items() if k != "intermediate_size"}  # experts are sized instead
    values = {**dense, **TINY_QWEN35_MOE, "vocab_size": vocab_size, **overrides}
    return Qwen3_5MoeTextConfig(**values)


def tiny_nemotron_h_config(vocab_size: int = 1024, **overrides: Any):
    """The tiny Nemotron-H (:data:`TINY_NEMOTRON_H`) as a transformers ``NemotronHConfig``."""
    from transformers import NemotronHConfig

    return NemotronHConfig(**{**TINY_NEMOTRON_H, "vocab_size": vocab_size, **overrides})


def tiny_qwen35_vl_config(
    vocab_size: int = 1024,
    *,
    moe: bool = False,
    text: Mapping[str, Any] | None = None,
    vision: Mapping[str, Any] | None = None,
    **overrides: Any,
):
    """The tiny Qwen3.5-VL: the tiny hybrid text model (tied embeddings, as Qwen3.5's small models; with ``moe``
    the MoE one) and :data:`TINY_VISION`, as a transformers ``Qwen3_5Config`` (``Qwen3_5MoeConfig``).

    ``text`` and ``vision`` override the two towers' values, ``overrides`` the top-level ones. The placeholder ids
    (:data:`VISION_TOKEN_FIELDS`) default to the last four ids of the vocabulary.
    """
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    text_config = (tiny_qwen35_moe_config if moe else tiny_qwen35_config)(vocab_size, **(text or {})).to_dict()
    vision_config = {**TINY_VISION, "out_hidden_size": text_config["hidden_size"], **(vision or {})}
    defaults = {name: text_config["vocab_size"] - 4 + i for i, name in enumerate(VISION_TOKEN_FIELDS)}
    tied = overrides.pop("tie_word_embeddings", True)
    return (Qwen3_5MoeConfig if moe else Qwen3_5Config)(
        text_config=text_config,
        vision_config=vision_config,
        tie_word_embeddings=tied,
        **{**defaults, **overrides},
    )
