"""The package installs with its workspace dependency and pulls no GPU-only kernel package."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.version import Version

from cp_core.testing import declared_version

PACKAGES = Path(__file__).resolve().parents[2]


def test_imports_with_dependencies():
    import transformers

    import cp_core
    import cp_models

    assert cp_models.__version__ == declared_version(PACKAGES / "cp-models" / "pyproject.toml")
    assert cp_core.__version__ == declared_version(PACKAGES / "cp-core" / "pyproject.toml")
    assert Version(transformers.__version__) >= Version("5.17")


def test_import_loads_no_gpu_kernels():
    """flash-linear-attention imports Triton kernels at import (which fails without a GPU): cp_models imports
    it only when a CUDA tensor is about to use it."""
    code = "import cp_models, sys; print(sorted(m for m in ('fla', 'mamba_ssm', 'flash_attn') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine installs the kernel packages")
def test_cpu_install_has_no_gpu_kernels():
    """transformers' Qwen3.5 picks fla's kernels whenever fla is installed and then fails on CPU tensors."""
    probe = "import importlib.util as u; print([m for m in ('fla', 'mamba_ssm') if u.find_spec(m)])"
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"
