"""The Qwen3.5 family spec (cp_models.families) builds cp_vlm's model for a VL config: checked here, since cp_models'
own tests run without cp_vlm installed."""

import torch

from cp_models.families import family_for
from cp_models.presets import tiny_qwen35_vl_config
from cp_vlm import Qwen35VLForConditionalGeneration


def test_vl_preset_builds_the_vl_model():
    config = tiny_qwen35_vl_config(vocab_size=96)
    family = family_for(config)
    assert family.is_vision_language(config)
    assert config.model_type in family.model_types
    torch.manual_seed(0)
    model = family.model_class_for(config)(config)
    assert type(model) is Qwen35VLForConditionalGeneration
    text = family.load_text_config(config)
    layer_types = set(getattr(text, family.layer_types_attribute)[: len(model.decoder_layers())])
    assert layer_types and layer_types <= set(family.layer_cp_styles)
