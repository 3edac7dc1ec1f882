"""What ships with the trainer: configs, tiny data and tokenizers, public model shapes and the tiny model presets."""

from __future__ import annotations

from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parents[1]
CONFIGS_DIR = _PACKAGE_DIR / "configs"
DEFAULT_CONFIG = CONFIGS_DIR / "tiny_cpu.toml"
SHIPPED_DATA = _PACKAGE_DIR / "assets" / "tiny_chat.jsonl"
SHIPPED_TOKENIZER = _PACKAGE_DIR / "assets" / "tiny_tokenizer"
SHIPPED_VL_DATA = _PACKAGE_DIR / "assets" / "tiny_vl_chat" / "data.jsonl"
SHIPPED_VL_PROCESSOR = _PACKAGE_DIR / "assets" / "tiny_vl_processor"
# Public model shapes (config.json of the real models, no weights): `model.config = "qwen3_5-0.8b"` etc.
SHIPPED_MODEL_CONFIGS = CONFIGS_DIR / "models"


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
