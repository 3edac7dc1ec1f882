"""sft_trainer.config: TOML + command-line overrides, and every rule checked at load with a clear message."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from pydantic import BaseModel

from sft_trainer.config import (
    DEFAULT_CONFIG,
    SHIPPED_DATA,
    SHIPPED_TOKENIZER,
    SHIPPED_VL_DATA,
    SHIPPED_VL_PROCESSOR,
    ConfigError,
    ParallelConfig,
    TrainConfig,
    config_from_dict,
    load_config,
    parse_overrides,
    resolve_model_config,
    tiny_qwen35_config,
    tiny_qwen35_vl_config,
)

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

# --------------------------------------------------------------------------------------------------------
# Model config files written into tmp_path; "{name}" in a case's overrides is replaced by that file's path.


def _text_config(**changes) -> dict:
    config = dict(
        model_type="qwen3_5_text",
        vocab_size=1024,  # room for the shipped tiny tokenizer's 649 tokens
        hidden_size=96,
        intermediate_size=64,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
    )
    config.update(changes)
    return config


MODEL_FILES = {
    "q6": _text_config(),  # 6 query heads, 2 KV heads
    "kv3": _text_config(num_key_value_heads=3),  # 6 query heads, 3 KV heads
    "conv8": _text_config(linear_conv_kernel_dim=8),
    "gelu": _text_config(hidden_act="gelu"),
    "dropout": _text_config(attention_dropout=0.1),
    "no_heads": _text_config(num_attention_heads=0, linear_num_key_heads=0),
    "float_width": _text_config(hidden_size=96.5),
    "layers_huge": {**_text_config(num_hidden_layers=10**9), "layer_types": None},  # transformers would loop
    "eps_negative": _text_config(rms_norm_eps=-1.0),
    "router_loss": _text_config(
        model_type="qwen3_5_moe_text",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        output_router_logits=True,
        router_aux_loss_coef=0.001,
    ),
    "vl": {
        "model_type": "qwen3_5",
        "text_config": {k: v for k, v in _text_config().items() if k != "model_type"},
        "vision_config": {"depth": 1, "hidden_size": 32, "num_heads": 2, "out_hidden_size": 96},
        # the shipped tiny VL processor's placeholder ids
        "image_token_id": 651,
        "video_token_id": 652,
        "vision_start_token_id": 649,
        "vision_end_token_id": 650,
    },
    "llama": {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4},
    # Nemotron-H: 6 Mamba heads in 3 groups (a2a fits cp 1, 3 only), 4 query / 2 KV attention heads
    "nemo6": {
        "model_type": "nemotron_h",
        "vocab_size": 1024,
        "hidden_size": 32,
        "hybrid_override_pattern": "M*-",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "mamba_num_heads": 6,
        "mamba_head_dim": 4,
        "n_groups": 3,
        "ssm_state_size": 8,
        "conv_kernel": 4,
        "intermediate_size": 48,
    },
    "nemo_no_mamba_heads": {
        "model_type": "nemotron_h",
        "hybrid_override_pattern": "M*E",
        "mamba_num_heads": 0,
        "n_routed_experts": 2,
        "num_experts_per_tok": 3,
    },
    "nemo_bad_pattern": {"model_type": "nemotron_h", "hybrid_override_pattern": "MXM"},
    "nemo_top_k": {
        "model_type": "nemotron_h",
        "hybrid_override_pattern": "ME",
        "n_routed_experts": 2,
        "num_experts_per_tok": 3,
    },
    "not_json": "{ this is not json",
}


@pytest.fixture
def model_files(tmp_path: Path) -> dict[str, str]:
    paths = {}
    for name, content in MODEL_FILES.items():
        folder = tmp_path / name
        folder.mkdir()
        text = content if isinstance(content, str) else json.dumps(content)
        (folder / "config.json").write_text(text)
        paths[name] = str(folder / "config.json")
    # checkpoint-like folders: config.json, the tokenizer and weight files (what the pre-launch checks look at)
    for variant, weights in (
        ("q6", {"model.safetensors": ""}),
        ("q6_pickle", {"pytorch_model.bin": "pickle"}),
        ("q6_shard_missing", {"model.safetensors.index.json": '{"weight_map": {"a": "model-1.safetensors"}}'}),
        ("q6_bad_index", {"model.safetensors.index.json": '{"metadata": {}}'}),
    ):
        folder = tmp_path / variant
        if variant != "q6":
            folder.mkdir()
            shutil.copy(tmp_path / "q6" / "config.json", folder / "config.json")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(SHIPPED_TOKENIZER / name, folder / name)
        for name, text in weights.items():
            (folder / name).write_text(text)
        paths[f"dir_{variant}"] = str(folder)
    (tmp_path / "kv3" / "model.safetensors").write_text("")
    paths["dir_kv3"] = str(tmp_path / "kv3")  # config.json and weights, no tokenizer
    paths["missing"] = str(tmp_path / "does_not_exist")
    (tmp_path / "notes.txt").write_text("not a data file")
    paths["text_file"] = str(tmp_path / "notes.txt")
    paths["vl_processor"] = str(SHIPPED_VL_PROCESSOR)
    return paths


def _default_data() -> dict:
    with DEFAULT_CONFIG.open("rb") as fh:
        return tomllib.load(fh)


def _merge(base: dict, changes: dict) -> dict:
    out = dict(base)
    for key, value in changes.items():
        out[key] = _merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def _build(case: dict | list, files: dict[str, str]) -> TrainConfig:
    """A dict is merged onto the default TOML; a list is overrides on top of it."""
    if isinstance(case, dict):
        return config_from_dict(_merge(_default_data(), case))
    return load_config(None, [token.format(**files) for token in case])


# --------------------------------------------------------------------------------------------------------
# The table: each invalid config and fragments its message must contain (field, value, rule).

INVALID = [
    (
        "seq_len_not_divisible_by_cp",
        ["--data.seq_len", "250", "--parallel.cp", "4"],
        ["data.seq_len=250", "divisible by parallel.cp=4"],
    ),
    (
        "micro_batch_2",
        ["--train.micro_batch_size", "2", "--parallel.cp", "1"],
        ["train.micro_batch_size=2", "must be 1 (a micro-batch is one packed row"],
    ),
    (
        "q_heads_not_divisible_by_cp",
        ["--model.config", "{q6}", "--parallel.cp", "4", "--data.seq_len", "256"],
        [
            "parallel.cp=4 with parallel.attention_cp='ulysses'",
            "num_attention_heads=6",
            "cp to divide the query heads",
            "choose cp in [1, 2, 3, 6]",
            "or use attention CP style 'kv_gather' or 'kv_ring' (or 'auto'), which take any cp",
        ],
    ),
    (
        "kv_heads_incompatible_with_cp",
        ["--model.config", "{kv3}", "--parallel.cp", "2"],
        ["parallel.cp=2", "num_key_value_heads=3", "cp | kv_heads or kv_heads | cp"],
    ),
    (
        "q_heads_from_checkpoint_folder",
        ["--model.path", "{dir_q6}", "--parallel.cp", "4"],
        ["model.path=", "num_attention_heads=6", "cp=4"],
    ),
    (
        "unknown_top_level_key",
        {"outptu_dir": "runs/x"},
        ["unknown key 'outptu_dir'", "valid keys in the top level: model, data, parallel"],
    ),
    (
        "unknown_nested_key_toml",
        {"parallel": {"tp": 2}},
        [
            "unknown key 'parallel.tp'",
            "valid keys in [parallel]: dp, cp, cp_style, attention_cp, fsdp, backend, collective_timeout_s, heartbeat_timeout_s, local_workers",
        ],
    ),
    (
        "unknown_nested_key_override",
        ["--train.lora.rnk", "4"],
        ["unknown key 'train.lora.rnk'", "valid keys in [train.lora]: enabled, rank, alpha"],
    ),
    (
        "unknown_section_override",
        ["--optim.lr", "1e-3"],
        ["unknown key 'optim'", "valid keys in the top level"],
    ),
    ("wrong_type_int", {"train": {"steps": "ten"}}, ["train.steps='ten'", "valid integer"]),
    ("wrong_type_bool", ["--model.compile", "1"], ["model.compile=1", "must be true or false"]),
    ("wrong_type_str", {"model": {"path": 5}}, ["model.path=5", "valid string"]),
    (
        "bad_enum_cp_style",
        ["--parallel.cp_style", "ring"],
        ["parallel.cp_style='ring'", "'auto', 'ulysses', 'state_passing' or 'a2a'"],
    ),
    ("bad_enum_dtype", {"model": {"dtype": "fp16"}}, ["model.dtype='fp16'", "'float32' or 'bfloat16'"]),
    ("bad_enum_decay", ["--train.decay", "exp"], ["train.decay='exp'", "'cosine', 'linear' or 'constant'"]),
    (
        "warmup_longer_than_run",
        ["--train.steps", "10", "--train.warmup_steps", "20"],
        ["train.warmup_steps=20", "<= train.steps=10"],
    ),
    (
        "lora_rank_0",
        ["--train.lora.enabled", "--train.lora.rank", "0"],
        ["train.lora.rank=0", "> 0 when train.lora.enabled"],
    ),
    (
        "lora_unknown_target",
        ["--train.lora.enabled=true", "--train.lora.targets", "q_proj,qkv"],
        ["train.lora.targets=['q_proj', 'qkv']", "['qkv'] are not linear layers", "in_proj_qkv"],
    ),
    (
        "vl_config_needs_ulysses",
        ["--model.config", "{vl}", "--parallel.cp_style", "state_passing"],
        ["parallel.cp_style='state_passing'", "vision-language", "requires cp_style='ulysses'"],
    ),
    (
        "unsupported_model_type",
        ["--model.config", "{llama}"],
        [
            "model.config=",
            "model_type='llama' is not supported",
            "nemotron_h, qwen3_5, qwen3_5_moe, qwen3_5_moe_text, qwen3_5_text",
        ],
    ),
    (
        "nemotron_h_a2a_needs_cp_dividing_mamba_heads",
        ["--model.config", "{nemo6}", "--parallel.cp", "4", "--parallel.cp_style", "a2a"],
        [
            "parallel.cp=4 with parallel.cp_style='a2a'",
            "mamba_num_heads=6, n_groups=3",
            "needs cp to divide the heads",
            "cp_style='state_passing' (any cp)",
        ],
    ),
    (
        "nemotron_h_a2a_groups_must_split_or_replicate",
        ["--model.config", "{nemo6}", "--parallel.cp", "2", "--parallel.cp_style", "a2a"],
        ["mamba_num_heads=6, n_groups=3", "cp | groups or groups | cp", "cp=2, groups=3"],
    ),
    (
        "nemotron_h_needs_a_mamba_style",
        ["--model.config", "{nemo6}", "--parallel.cp_style", "ulysses"],
        ["parallel.cp_style='ulysses'", "'linear_attention' (layers [0]", "'state_passing' or 'a2a'"],
    ),
    (
        "nemotron_h_lora_targets_its_own_names",
        ["--model.config", "{nemo6}", "--train.lora.enabled=true", "--train.lora.targets", "in_proj_qkv"],
        ["['in_proj_qkv'] are not linear layers", "in_proj, out_proj"],
    ),
    (
        "nemotron_h_conv_halo",
        ["--model.config", "{nemo6}", "--data.seq_len", "4", "--parallel.cp", "2"],
        ["data.seq_len=4", "Mamba conv_kernel-1=3"],
    ),
    (
        "layer_types_unsupported_under_style",
        ["--parallel.cp_style", "a2a"],
        [
            "parallel.cp_style='a2a'",
            "'linear_attention' (layers [0, 1, 2]",
            "'full_attention' (layers [3]",
            "'ulysses'",
        ],
    ),
    (
        "seq_len_too_short_for_conv_halo",
        ["--data.seq_len", "4", "--parallel.cp", "2"],
        ["data.seq_len=4", "parallel.cp=2", "GDN conv halo", "linear_conv_kernel_dim-1=3", "seq_len >= cp * 3 = 6"],
    ),
    (
        "gdn_with_another_activation",
        ["--model.config", "{gelu}"],
        ["model.config=", "hidden_act='gelu'", "silu only", "hidden_act 'silu'"],
    ),
    ("attention_dropout", ["--model.config", "{dropout}"], ["attention_dropout=0.1", '"attention_dropout": 0.0']),
    (
        "zero_heads",
        ["--model.config", "{no_heads}"],
        ["model.config=", "num_attention_heads=0: must be a positive integer", "linear_num_key_heads=0: must be a"],
    ),
    (
        "float_width",
        ["--model.config", "{float_width}"],
        ["hidden_size", "96.5"],  # transformers' own type check where it has one, else ours
    ),
    (
        "layers_huge",
        ["--model.config", "{layers_huge}"],
        ["num_hidden_layers=1000000000: must be at most 10000"],
    ),
    ("eps_negative", ["--model.config", "{eps_negative}"], ["rms_norm_eps=-1.0: must be a finite number >= 0"]),
    ("nemotron_zero_heads", ["--model.config", "{nemo_no_mamba_heads}"], ["mamba_num_heads=0: must be a positive"]),
    (
        "nemotron_unknown_layer_in_pattern",
        ["--model.config", "{nemo_bad_pattern}"],
        ["hybrid_override_pattern='MXM': 'X' is not a layer; use M (Mamba-2), * (attention), - (MLP), E (MoE)"],
    ),
    (
        "nemotron_top_k_over_experts",
        ["--model.config", "{nemo_top_k}"],
        ["num_experts_per_tok=3 must be at most n_routed_experts=2"],
    ),
    (
        "router_load_balancing_loss",
        ["--model.config", "{router_loss}"],
        ["output_router_logits=true", "router_aux_loss_coef=0.001", '"output_router_logits": false'],
    ),
    (
        "seq_len_too_short_for_wide_conv",
        ["--model.config", "{conv8}", "--data.seq_len", "12", "--parallel.cp", "2"],
        ["data.seq_len=12", "linear_conv_kernel_dim-1=7", ">= cp * 7 = 14"],
    ),
    (
        "processor_for_a_text_model",
        ["--data.processor", "{vl_processor}"],
        ["data.processor=", "text-only model", "model.preset = 'tiny-qwen3_5-vl'"],
    ),
    (
        "processor_folder_without_config",
        ["--model.preset", "tiny-qwen3_5-vl", "--data.processor", "{dir_q6}"],
        ["data.processor=", "preprocessor_config.json"],
    ),
    (
        "vl_preset_needs_ulysses",
        ["--model.preset", "tiny-qwen3_5-vl", "--parallel.cp_style", "state_passing"],
        ["parallel.cp_style='state_passing'", "vision-language", "cp_style='ulysses'"],
    ),
    ("vision_cp_unknown", ["--model.vision_cp", "split"], ["model.vision_cp='split'", "'shard' or 'replicate'"]),
    ("cp_zero", ["--parallel.cp", "0"], ["parallel.cp=0", "greater than or equal to 1"]),
    ("dp_zero", ["--parallel.dp", "0"], ["parallel.dp=0", "must be >= 1, or -1"]),
    ("lr_zero", ["--train.lr", "0"], ["train.lr=0", "greater than 0"]),
    ("grad_accum_zero", ["--train.grad_accum=0"], ["train.grad_accum=0", "greater than or equal to 1"]),
    ("beta_out_of_range", ["--train.betas", "[0.9, 1.0]"], ["train.betas=[0.9, 1.0]", "each beta must be in [0, 1)"]),
    (
        "local_workers_mismatch",
        ["--parallel.local_workers", "4"],
        ["parallel.local_workers=4", "must equal parallel.dp * parallel.cp = 1 * 2 = 2"],
    ),
    (
        "path_and_config_both",
        ["--model.path", "{dir_q6}", "--model.config", "{q6}"],
        ["model.path=", "model.config=", "not both"],
    ),
    ("model_path_missing", ["--model.path", "{missing}"], ["model.path=", "no such folder; model.path is an HF"]),
    ("model_path_a_file", ["--model.path", "{text_file}"], ["model.path=", "notes.txt': not a folder"]),
    ("data_path_empty", ["--data.path", ""], ["data.path='': must not be empty: give a value"]),
    ("tokenizer_empty", ["--data.tokenizer", ""], ["data.tokenizer='': must not be empty: give a value"]),
    ("column_empty", ["--data.messages_column", ""], ["data.messages_column='': must not be empty"]),
    ("output_dir_empty", ["--output_dir", ""], ["output_dir='': must not be empty: give a value"]),
    ("steps_past_a_billion", ["--train.steps", "10" * 12], ["train.steps=1010", "less than or equal to 1000000000"]),
    (
        "pickle_weights_only",
        ["--model.path", "{dir_q6_pickle}"],
        ["no model.safetensors", "holds pytorch_model.bin: pickle weights, never loaded (unpickling can run code)"],
    ),
    (
        "index_names_a_missing_shard",
        ["--model.path", "{dir_q6_shard_missing}"],
        ["model.safetensors.index.json names model-1.safetensors, which is missing"],
    ),
    ("index_without_weight_map", ["--model.path", "{dir_q6_bad_index}"], ["is not a safetensors index"]),
    ("model_config_not_json", ["--model.config", "{not_json}"], ["model.config=", "cannot read", "as JSON"]),
    ("data_path_missing", ["--data.path", "{missing}"], ["data.path=", "no such file or folder"]),
    (
        "tokenizer_folder_without_tokenizer",
        ["--data.tokenizer", "{dir_kv3}"],
        ["data.tokenizer=", "kv3", "holds no tokenizer", "tokenizer.json", "save_pretrained"],
    ),
    (
        "data_path_unknown_type",
        ["--data.path", "{text_file}"],
        ["data.path=", "notes.txt", "unsupported data file type '.txt'", "use .jsonl, .json or .parquet"],
    ),
    ("resume_path_missing", ["--checkpoint.resume", "{missing}"], ["checkpoint.resume=", "no such checkpoint"]),
    ("section_set_as_value", ["--train.lora", "3"], ["'train.lora' is a section", "enabled, rank"]),
    ("value_used_as_section", ["--model.path.x", "3"], ["'model.path' is a value, not a section"]),
    ("not_an_option", ["parallel.cp", "2"], ["unexpected argument 'parallel.cp'", "--section.key VALUE"]),
]


@pytest.mark.parametrize("case, fragments", [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_config_names_field_value_and_rule(case, fragments, model_files):
    with pytest.raises(ConfigError) as info:
        _build(case, model_files)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in:\n{message}"


def test_table_covers_enough_cases():
    assert len(INVALID) >= 12


def test_all_problems_are_collected():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["--data.seq_len", "255", "--train.micro_batch_size", "2", "--train.warmup_steps", "99"])
    assert len(info.value.problems) == 3
    assert "3 problems" in str(info.value)
    with pytest.raises(ConfigError) as info:
        config_from_dict({"train": {"steps": "x", "lr": -1.0, "bogus": 1}})
    assert len(info.value.problems) == 3


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


# --------------------------------------------------------------------------------------------------------
# Valid configs


def test_default_config_loads():
    cfg = load_config(None, [])
    assert cfg == load_config(DEFAULT_CONFIG, []) == load_config("tiny_cpu", [])
    assert cfg.model.preset == "tiny-qwen3_5" and cfg.model.path is None and cfg.model.config is None
    assert cfg.parallel.cp == 2 and cfg.parallel.backend == "gloo" and cfg.parallel.num_local_workers == 2
    assert 30 <= cfg.train.steps <= 60
    assert cfg.data.seq_len % cfg.parallel.cp == 0
    assert cfg.data.path is None and Path(cfg.data_path) == SHIPPED_DATA and SHIPPED_DATA.is_file()
    assert Path(cfg.tokenizer_path) == SHIPPED_TOKENIZER and SHIPPED_TOKENIZER.is_dir()
    assert not cfg.vision_language and cfg.processor_path is None
    # The VL config: the shipped image set and the processor folder (tokenizer + image processor).
    vl = load_config("tiny_vl_cpu", [])
    assert vl.vision_language and vl.model.vision_cp == "shard"
    assert Path(vl.data_path) == SHIPPED_VL_DATA and Path(vl.tokenizer_path) == SHIPPED_VL_PROCESSOR
    assert Path(vl.processor_path) == SHIPPED_VL_PROCESSOR
    assert load_config(None, ["--model.preset", "tiny-qwen3_5-vl"]).data_path == vl.data_path
    assert cfg.checkpoint_dir == Path(cfg.output_dir) / "checkpoints"
    assert cfg.metrics_path == Path(cfg.output_dir) / "metrics.jsonl"


def test_toml_plus_overrides(tmp_path: Path, model_files):
    toml = tmp_path / "run.toml"
    toml.write_text(
        f"""
output_dir = "{tmp_path / "out"}"
[model]
config = "{model_files["q6"]}"
preset = "tiny-qwen3_5"
dtype = "bfloat16"
[data]
seq_len = 64
[parallel]
dp = -1
cp = 2
[train]
steps = 12
lr = 1e-3
[train.lora]
enabled = true
rank = 4
"""
    )
    cfg = load_config(str(toml), ["--train.steps=20", "--parallel.cp", "6", "--data.seq_len", "96", "--model.compile"])
    assert cfg.model.config == model_files["q6"] and cfg.model.dtype == "bfloat16" and cfg.model.compile is True
    assert (cfg.train.steps, cfg.train.lr, cfg.parallel.cp, cfg.data.seq_len) == (20, 1e-3, 6, 96)
    assert cfg.parallel.dp == -1 and cfg.parallel.num_local_workers == 6
    assert cfg.train.lora.enabled and cfg.train.lora.rank == 4 and cfg.train.lora.alpha == 16.0  # default kept
    assert cfg.train.grad_accum == 1 and cfg.logging.wandb.mode == "offline"  # untouched sections take defaults
    assert cfg.checkpoint_dir == tmp_path / "out" / "checkpoints"
    # 6 query and 2 KV heads: cp=6 is fine, cp=4 is not for Ulysses, the default (the message proposes the divisors
    # and the other strategy) ...
    with pytest.raises(ConfigError, match=r"choose cp in \[1, 2, 3, 6\]; or use attention CP style 'kv_gather'"):
        load_config(str(toml), ["--parallel.cp", "4"])
    # ... but is for all-gathered or ring-passed KV, forced, or all-gathered KV picked by "auto"
    for style in ("kv_gather", "kv_ring", "auto"):
        assert load_config(str(toml), ["--parallel.cp", "4", "--parallel.attention_cp", style]).parallel.cp == 4
    with pytest.raises(ConfigError, match=r"parallel\.attention_cp"):
        load_config(str(toml), ["--parallel.attention_cp", "ring"])


def test_checkpoint_folder_and_vl_config(model_files):
    cfg = load_config(None, ["--model.path", model_files["dir_q6"], "--parallel.cp", "2"])
    assert resolve_model_config(cfg.model).num_attention_heads == 6
    cfg = load_config(None, ["--model.config", model_files["vl"]])
    vl = resolve_model_config(cfg.model)
    assert vl.model_type == "qwen3_5" and vl.text_config.num_attention_heads == 6


@pytest.mark.parametrize(
    "override, get, expected",
    [
        (["--train.lr=1e-4"], lambda c: c.train.lr, 1e-4),
        (["--train.lr", "1"], lambda c: c.train.lr, 1.0),
        (["--train.steps", "50"], lambda c: c.train.steps, 50),
        (["--model.compile"], lambda c: c.model.compile, True),
        (["--model.activation_checkpointing=false"], lambda c: c.model.activation_checkpointing, False),
        (["--logging.wandb.enabled", "true"], lambda c: c.logging.wandb.enabled, True),
        (["--logging.wandb.run_name", "123"], lambda c: c.logging.wandb.run_name, "123"),
        (["--logging.wandb.project", '"quoted name"'], lambda c: c.logging.wandb.project, "quoted name"),
        (["--logging.metrics_file", "m.jsonl"], lambda c: c.metrics_path, Path("m.jsonl")),
        (["--checkpoint.dir", "/ckpt", "--checkpoint.dir", "null"], lambda c: c.checkpoint.dir, None),
        (["--output_dir", "/tmp/run-2024"], lambda c: c.output_dir, "/tmp/run-2024"),
        (["--output_dir", "2024-01-01"], lambda c: c.output_dir, "2024-01-01"),
        (["--train.lora.targets", "q_proj,v_proj"], lambda c: c.train.lora.targets, ["q_proj", "v_proj"]),
        (["--train.lora.targets", '["o_proj"]'], lambda c: c.train.lora.targets, ["o_proj"]),
        (["--train.betas", "[0.8, 0.99]"], lambda c: c.train.betas, (0.8, 0.99)),
        (["--checkpoint.resume", "true"], lambda c: c.checkpoint.resume, True),
        (["--parallel.dp", "-1"], lambda c: c.parallel.dp, -1),
        (["--train.grad-accum", "3"], lambda c: c.train.grad_accum, 3),
        (["--data.overlong", "drop"], lambda c: c.data.overlong, "drop"),
    ],
)
def test_override_value_parsing(override, get, expected):
    value = get(load_config(None, override))
    assert value == expected and type(value) is type(expected)


def test_resume_from_existing_path(tmp_path: Path):
    cfg = load_config(None, ["--checkpoint.resume", str(tmp_path)])
    assert cfg.checkpoint.resume == str(tmp_path)


def test_parse_overrides():
    assert parse_overrides(["--a.b", "1", "--c=x=y", "--flag", "--d", "-2", "--e-f"]) == [
        ("a.b", "1"),
        ("c", "x=y"),
        ("flag", "true"),
        ("d", "-2"),
        ("e_f", "true"),
    ]


def test_missing_config_file_lists_shipped_ones(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"does not exist \(shipped configs: .*tiny_cpu"):
        load_config(str(tmp_path / "nope.toml"), [])
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 3")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(str(bad), [])
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe[train]\n")
    with pytest.raises(ConfigError, match=r"binary\.toml: not UTF-8 text \(invalid start byte at byte 0\)"):
        load_config(str(binary), [])


def test_parallel_resolution():
    par = ParallelConfig(dp=-1, cp=2)
    assert par.resolve_dp(8) == 4 and par.num_local_workers == 2
    assert ParallelConfig(dp=2, cp=2).resolve_dp(4) == 2
    with pytest.raises(
        ConfigError, match=re.escape("parallel.dp=2 x parallel.cp=2 = 4 ranks, but the world size is 8")
    ):
        ParallelConfig(dp=2, cp=2).resolve_dp(8)
    with pytest.raises(
        ConfigError, match=re.escape("parallel.cp=4 must divide the world size 6: start a multiple of 4")
    ):
        ParallelConfig(dp=-1, cp=4).resolve_dp(6)


def _models(cls: type[BaseModel]):
    yield cls
    for field in cls.model_fields.values():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from _models(field.annotation)


def test_every_field_documented_and_extra_forbidden():
    for cls in _models(TrainConfig):
        assert cls.model_config.get("extra") == "forbid", cls.__name__
        for name, field in cls.model_fields.items():
            assert field.description, f"{cls.__name__}.{name} has no description"


# --------------------------------------------------------------------------------------------------------
# The tiny preset


def test_nemotron_h_config_and_preset_resolve_their_style(model_files):
    cfg = load_config(None, ["--model.config", model_files["nemo6"], "--parallel.cp", "2"])  # a2a could not: 3 groups
    assert cfg.parallel.cp_style == "auto" and cfg.parallel.resolve_cp_style("nemotron_h") == "state_passing"
    cfg = load_config(None, ["--model.preset", "tiny-nemotron_h", "--parallel.cp_style", "a2a", "--parallel.cp", "4"])
    assert resolve_model_config(cfg.model).model_type == "nemotron_h"
    assert load_config(None, []).parallel.resolve_cp_style("qwen3_5") == "ulysses"


def test_tiny_preset_is_a_hybrid_that_runs():
    from cp_core import check_ulysses_heads
    from cp_models import Qwen35ForCausalLM

    config = tiny_qwen35_config(vocab_size=97)
    assert type(config).__name__ == "Qwen3_5TextConfig" and config.vocab_size == 97
    assert set(config.layer_types) == {"linear_attention", "full_attention"}
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (
        64,
        4,
        2,
        16,
    )
    assert (config.linear_num_key_heads, config.linear_num_value_heads, config.linear_conv_kernel_dim) == (2, 4, 4)
    for cp in (1, 2, 4):
        check_ulysses_heads(config.num_attention_heads, config.num_key_value_heads, cp)
    torch.manual_seed(0)
    model = Qwen35ForCausalLM(config)
    ids = torch.randint(0, 97, (24,))
    out = model(ids, [10, 14])
    assert out.logits.shape == (24, 97) and torch.isfinite(out.logits).all()


# name -> (model_type, layers, hidden, attention q / kv heads): the public configs (REFERENCE.md)
SHIPPED_SHAPES = {
    "qwen3_5-0.8b": ("qwen3_5_text", 24, 1024, 8, 2),
    "qwen3_5-2b": ("qwen3_5_text", 24, 2048, 8, 2),
    "qwen3_5-35b-a3b": ("qwen3_5_moe_text", 40, 2048, 16, 2),
    "nemotron_h-nano-30b-a3b": ("nemotron_h", 52, 2688, 32, 2),
}


@pytest.mark.parametrize("name", sorted(SHIPPED_SHAPES))
def test_shipped_model_shapes_resolve_by_name(name):
    model_type, layers, hidden, q_heads, kv_heads = SHIPPED_SHAPES[name]
    cfg = load_config(None, ["--model.config", name, "--data.seq_len", "8192", "--parallel.cp", "2"])
    hf = resolve_model_config(cfg.model)
    assert (hf.model_type, hf.num_hidden_layers, hf.hidden_size) == (model_type, layers, hidden)
    assert (hf.num_attention_heads, hf.num_key_value_heads) == (q_heads, kv_heads)
    if model_type == "nemotron_h":  # Nano: 23 Mamba, 6 attention, 23 MoE
        assert sorted(hf.hybrid_override_pattern.count(c) for c in "M*E") == [6, 23, 23]
    else:
        assert hf.layer_types[: hf.num_hidden_layers].count("full_attention") == layers // 4


def test_unknown_model_config_name_lists_the_shipped_shapes():
    with pytest.raises(
        ConfigError, match=r"does not exist \(shipped model.config shapes: nemotron_h-nano-30b-a3b, qwen"
    ):
        load_config(None, ["--model.config", "qwen3_5-9b"])


def test_a_key_that_needs_a_value_says_so():
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["--train.steps"])
    assert "--train.steps needs a value: --train.steps VALUE (only true/false keys may stand alone)" in str(exc.value)
    assert load_config(None, ["--model.activation_checkpointing"]).model.activation_checkpointing is True
    with pytest.raises(ConfigError, match=r"parallel\.fsdp='no': must be true or false"):
        load_config(None, ["--parallel.fsdp", "no"])


def test_config_given_twice_or_without_a_file_is_refused():
    from sft_trainer.cli import split_config_argument

    assert split_config_argument(["--a", "1", "--config=x.toml", "--b"]) == ("x.toml", ["--a", "1", "--b"])
    with pytest.raises(ConfigError, match=r"--config given twice \('tiny_cpu' and 'tiny_vl_cpu'\)"):
        split_config_argument(["--config", "tiny_cpu", "--train.steps", "3", "--config=tiny_vl_cpu"])
    for argv in (["--config"], ["--config", "--train.steps", "3"]):
        with pytest.raises(ConfigError, match="--config needs a value"):
            split_config_argument(argv)


@pytest.mark.parametrize("command", [[], ["plan"]])
def test_help_lists_every_key_with_its_default(capsys, command):
    from sft_trainer.cli import main
    from sft_trainer.config import TrainConfig

    main([*command, "--config", "tiny_cpu", "--help"])  # anywhere on the line
    out = capsys.readouterr().out
    # a section's own keys come before its subsections, so none sits under another's header
    assert out.index("--output_dir (") < out.index("[model]")
    assert out.index("--logging.progress_bar") < out.index("[logging.wandb]")
    assert "--train.betas (tuple, value [0.9, 0.95])" in out and ("sft-train plan --help" in out) != bool(command)
    assert out.startswith(f"usage: sft-train{' plan' if command else ''} [--config FILE.toml]")
    assert "--data.seq_len (int, value 256)" in out
    assert '--parallel.attention_cp ("ulysses"|"kv_gather"|"kv_ring"|"auto", value "ulysses")' in out
    assert ("--gpu-memory-gib" in out) == bool(command)

    def keys(cls, prefix=""):
        for name, field in cls.model_fields.items():
            sub = (
                field.annotation
                if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
                else None
            )
            yield from keys(sub, f"{prefix}{name}.") if sub else [f"{prefix}{name}"]

    missing = [k for k in keys(TrainConfig) if f"  --{k} (" not in out]
    assert not missing, missing


# --------------------------------------------------------------------------------------------------------
# A checkpoint's own tokenizer, and what a run naming a checkpoint starts from


def test_checkpoint_tokenizer_is_the_default_and_must_fit(model_files, tmp_path):
    cfg = load_config(None, ["--model.path", model_files["dir_q6"]])
    assert cfg.tokenizer_path == model_files["dir_q6"]
    given = load_config(None, ["--model.path", model_files["dir_q6"], "--data.tokenizer", str(SHIPPED_TOKENIZER)])
    assert given.tokenizer_path == str(SHIPPED_TOKENIZER)
    with pytest.raises(ConfigError) as info:
        load_config(None, ["--model.path", model_files["dir_kv3"]])
    assert str(info.value).count("\n") == 0 and "holds no tokenizer" in str(info.value)
    assert f"model.path={model_files['dir_kv3']!r}" in str(info.value) and "set data.tokenizer" in str(info.value)

    small = tmp_path / "small"  # a checkpoint folder whose vocabulary is smaller than its tokenizer's
    small.mkdir()
    (small / "config.json").write_text(json.dumps(_text_config(vocab_size=600)))
    (small / "model.safetensors").write_text("")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SHIPPED_TOKENIZER / name, small / name)
    with pytest.raises(ConfigError) as info:
        load_config(None, ["--model.path", str(small)])
    message = str(info.value)
    assert message.count("\n") == 0 and "649 tokens (ids up to 648)" in message and "vocab_size=600" in message
    # the checkpoint's own tokenizer is the misfit: the fix is its config.json or another tokenizer
    assert message.endswith("the checkpoint's own tokenizer and its config.json disagree: fix vocab_size there, or "
                            "set data.tokenizer to the tokenizer made for this checkpoint")  # fmt: skip
    with pytest.raises(ConfigError, match=r"the shipped tokenizer .*649 tokens .* vocab_size=128"):
        (tmp_path / "q128.json").write_text(json.dumps(_text_config(vocab_size=128)))
        load_config(None, ["--model.config", str(tmp_path / "q128.json")])


def test_messages_name_the_tokenizer_by_where_it_comes_from(model_files):
    assert load_config(None, []).tokenizer_field == f"the shipped tokenizer {str(SHIPPED_TOKENIZER)!r}"
    checkpoint = load_config(None, ["--model.path", model_files["dir_q6"]])
    assert checkpoint.tokenizer_field == f"the tokenizer of model.path={model_files['dir_q6']!r}"
    given = load_config(None, ["--model.path", model_files["dir_q6"], "--data.tokenizer", str(SHIPPED_TOKENIZER)])
    assert given.tokenizer_field == f"data.tokenizer={str(SHIPPED_TOKENIZER)!r}"


def test_special_tokens_outside_the_vocabulary_are_refused(tmp_path):
    from sft_trainer.tokenizer_fit import load_tokenizer, tokenizer_problems

    tokenizer = load_tokenizer(SHIPPED_TOKENIZER)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|extra|>"]})  # id 649
    config = tiny_qwen35_config(vocab_size=649)
    problems = tokenizer_problems(tokenizer, config, "data.tokenizer='t'", "model.path='m'")
    assert problems == [
        "data.tokenizer='t' has 650 tokens (ids up to 649) but model.path='m' has vocab_size=649: its ids must be "
        "below vocab_size; use the checkpoint's own tokenizer (the default for model.path) or one made for it"
    ]
    assert tokenizer_problems(tokenizer, tiny_qwen35_config(vocab_size=650), "t", "m") == []
    vl = tiny_qwen35_vl_config(vocab_size=1024, image_token_id=651, vision_start_token_id=600)
    vl_tokenizer = load_tokenizer(SHIPPED_VL_PROCESSOR)
    assert tokenizer_problems(vl_tokenizer, vl, "t", "m") == [
        "t does not match the VL model m: vision_start_token_id=600 but the tokenizer's <|vision_start|> is 649"
    ]


def test_a_checkpoint_run_without_config_starts_from_the_schema_defaults(model_files, capsys):
    from sft_trainer.cli import main

    tiny = load_config(None, [])
    assert (tiny.parallel.cp, tiny.train.lr, tiny.train.warmup_steps) == (2, 3e-3, 4)
    cfg = load_config(None, ["--model.path", model_files["dir_q6"]])
    assert cfg == TrainConfig(model={"path": model_files["dir_q6"]})  # nothing from tiny_cpu.toml
    assert (cfg.parallel.cp, cfg.train.lr, cfg.train.warmup_steps, cfg.output_dir) == (1, 3e-4, 0, "outputs")
    with_file = load_config("tiny_cpu", ["--model.path", model_files["dir_q6"]])
    assert (with_file.parallel.cp, with_file.train.lr) == (2, 3e-3)  # an explicit --config still applies

    main(["--model.path", model_files["dir_q6"], "--train.lr", "1e-5", "--help"])
    out = capsys.readouterr().out
    assert "--parallel.cp (int, value 1)" in out and "--train.lr (float, value 1e-05)" in out
    assert "--train.warmup_steps (int, value 0)" in out and "(schema defaults + overrides)" in out
    main(["--help"])
    out = capsys.readouterr().out
    assert "--parallel.cp (int, value 2)" in out and "--train.lr (float, value 0.003)" in out and "tiny_cpu.toml" in out
    assert "Nemotron-H" in out.split("  --model.path (")[1].split("  --model.config (")[0]
