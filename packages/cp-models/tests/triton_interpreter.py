"""Whether Triton's interpreter can run the models' kernels on the CPU here (the tests that use it skip otherwise)."""

from __future__ import annotations

import importlib.util
import re
from importlib.metadata import version

import pytest


def _release(package: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", version(package)).groups()
    return int(major), int(minor)


def interpreter_problem() -> str | None:
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("numpy") is None:
        return "needs Triton and NumPy (Triton's interpreter runs on CPU)"
    if _release("triton") < (3, 7) and _release("numpy") >= (2, 4):
        # Triton 3.6's interpreter turns a loop bound passed as an argument into a Python int through a
        # 1-element array, which NumPy 2.4 refuses; the compiled kernels are not affected.
        return (
            f"Triton {version('triton')}'s interpreter cannot run loops bounded by an argument with NumPy "
            f"{version('numpy')}: use Triton >= 3.7 or NumPy < 2.4"
        )
    return None


needs_triton_interpreter = pytest.mark.skipif(interpreter_problem() is not None, reason=str(interpreter_problem()))
