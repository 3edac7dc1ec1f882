"""What an install test checks a package's ``__version__`` against."""

from __future__ import annotations

import os


def declared_version(pyproject: str | os.PathLike) -> str:
    """The ``[project] version`` a package's pyproject.toml declares (what its ``__version__`` must say)."""
    import tomllib

    with open(pyproject, "rb") as f:
        return tomllib.load(f)["project"]["version"]
