"""The trainer installs with the whole stack beneath it."""

from packaging.version import Version


def test_imports_with_dependencies():
    import pydantic

    import cp_vlm
    import sft_trainer

    assert sft_trainer.__version__ == "0.1.0"
    assert cp_vlm.__version__ == "0.1.0"
    assert Version(pydantic.VERSION) >= Version("2.7")
