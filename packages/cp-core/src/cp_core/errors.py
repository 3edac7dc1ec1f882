"""Exceptions raised by cp_core.

Every check that can fail runs on host-side values that all ranks of a CP group share (global document
lengths, tensor shapes, head counts), so every rank raises the same error before any collective is issued
and no rank is left waiting in a collective.
"""


class ContextParallelError(ValueError):
    """Invalid input or configuration for context-parallel execution."""
