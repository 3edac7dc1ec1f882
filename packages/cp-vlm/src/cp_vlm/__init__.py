"""Qwen3.5-VL context-parallel model (in progress)."""

__version__ = "0.1.0"
