"""Qwen3.5 and Nemotron-H models with context-parallel hooks (in progress)."""

__version__ = "0.1.0"
