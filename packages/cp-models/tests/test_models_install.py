"""The package installs with its workspace dependency and pulls no GPU-only kernel package."""

import subprocess
import sys

from packaging.version import Version


def test_imports_with_dependencies():
    import transformers

    import cp_core
    import cp_models

    assert cp_models.__version__ == "0.1.0"
    assert cp_core.__version__ == "0.1.0"
    assert Version(transformers.__version__) >= Version("5.17")


def test_cpu_install_has_no_gpu_kernels():
    code = "import cp_models, sys; print(sorted(m for m in ('fla', 'mamba_ssm', 'flash_attn') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"
    probe = "import importlib.util as u; print([m for m in ('fla', 'mamba_ssm') if u.find_spec(m)])"
    assert (
        subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout.strip() == "[]"
    )
