"""cp_vlm: Qwen3.5-VL for context-parallel SFT (transformers' vision tower, cp_models' text model)."""

from cp_vlm.positions import packed_mrope_positions
from cp_vlm.qwen3_5_vl import (
    VISION_CP_MODES,
    Qwen35VLForConditionalGeneration,
    VisionCP,
    balance_images,
    load_vl_config,
)

__version__ = "0.1.0"

__all__ = [
    "VISION_CP_MODES",
    "Qwen35VLForConditionalGeneration",
    "VisionCP",
    "balance_images",
    "load_vl_config",
    "packed_mrope_positions",
]
