"""What ships with the trainer: configs, tiny data and tokenizers, public model shapes; the tiny model presets
(cp_models.presets) by name."""

from __future__ import annotations

from pathlib import Path

from cp_models import families
from cp_models.presets import tiny_nemotron_h_config, tiny_qwen35_config, tiny_qwen35_vl_config  # noqa: F401 (re-exported)

_PACKAGE_DIR = Path(__file__).resolve().parents[1]
CONFIGS_DIR = _PACKAGE_DIR / "configs"
DEFAULT_CONFIG = CONFIGS_DIR / "tiny_cpu.toml"
SHIPPED_DATA = _PACKAGE_DIR / "assets" / "tiny_chat.jsonl"
SHIPPED_TOKENIZER = _PACKAGE_DIR / "assets" / "tiny_tokenizer"
SHIPPED_VL_DATA = _PACKAGE_DIR / "assets" / "tiny_vl_chat" / "data.jsonl"
SHIPPED_VL_PROCESSOR = _PACKAGE_DIR / "assets" / "tiny_vl_processor"
# Public model shapes (config.json of the real models, no weights): `model.config = "qwen3_5-0.8b"` etc.
SHIPPED_MODEL_CONFIGS = CONFIGS_DIR / "models"


PRESETS = families.PRESETS  # the tiny models by ``model.preset`` name, declared with their family in cp_models
