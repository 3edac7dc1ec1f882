"""Qwen3.5-VL context-parallel model (in progress)."""

from cp_vlm.positions import packed_mrope_positions

__version__ = "0.1.0"

__all__ = ["packed_mrope_positions"]
