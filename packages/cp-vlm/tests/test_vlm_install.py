"""The package installs with its workspace dependencies (dependencies flow core <- models <- vlm)."""


def test_imports_with_dependencies():
    import cp_core
    import cp_models
    import cp_vlm

    assert (cp_core.__version__, cp_models.__version__, cp_vlm.__version__) == ("0.1.0", "0.1.0", "0.1.0")


def test_lower_layers_do_not_import_upper_ones():
    import subprocess
    import sys

    code = "import cp_core, cp_models, sys; print('cp_vlm' in sys.modules, 'sft_trainer' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.split() == ["False", "False"]
