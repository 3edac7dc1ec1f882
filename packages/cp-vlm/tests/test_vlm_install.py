"""The package installs with its workspace dependencies (dependencies flow core <- models <- vlm)."""

from pathlib import Path

from cp_core.testing import declared_version

PACKAGES = Path(__file__).resolve().parents[2]


def test_imports_with_dependencies():
    import cp_core
    import cp_models
    import cp_vlm

    for name, module in (("cp-core", cp_core), ("cp-models", cp_models), ("cp-vlm", cp_vlm)):
        assert module.__version__ == declared_version(PACKAGES / name / "pyproject.toml"), name


def test_lower_layers_do_not_import_upper_ones():
    import subprocess
    import sys

    code = "import cp_core, cp_models, sys; print('cp_vlm' in sys.modules, 'sft_trainer' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.split() == ["False", "False"]
