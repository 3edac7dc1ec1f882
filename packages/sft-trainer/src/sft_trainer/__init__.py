"""Context-parallel SFT trainer (in progress)."""

__version__ = "0.1.0"
