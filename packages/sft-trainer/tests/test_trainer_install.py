"""The trainer installs with the whole stack beneath it, at the versions its packages declare."""

from pathlib import Path

from packaging.version import Version

from cp_core.testing import declared_version

PACKAGES = Path(__file__).resolve().parents[2]


def test_imports_with_dependencies():
    import pydantic

    import cp_vlm
    import sft_trainer

    assert sft_trainer.__version__ == declared_version(PACKAGES / "sft-trainer" / "pyproject.toml")
    assert cp_vlm.__version__ == declared_version(PACKAGES / "cp-vlm" / "pyproject.toml")
    assert Version(pydantic.VERSION) >= Version("2.7")  # the pydantic features the config schema uses
    assert callable(sft_trainer.main) and "TrainConfig" in sft_trainer.__all__
