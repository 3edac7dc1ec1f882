"""sft_trainer.plan (``sft-train plan``): parameter counts equal the real models', the byte closed forms equal what
the layers send on a ``fake`` process group, the longest-row solver is tight, impossible configs are refused with
the numbers that fix them, and the CLI prints a table and JSON."""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from cp_core import CPTopology, build_packed_metadata
from cp_core.testing import CommCounter, fake_process_group
from cp_models import (
    ContextParallelModule,
    NemotronHForCausalLM,
    Qwen35ForCausalLM,
    load_text_config,
    set_context_parallel_attributes,
)
from cp_models.nemotron_h import NemotronHBlock
from cp_models.qwen3_5 import Qwen35DecoderLayer, Qwen35Rotary
from sft_trainer import plan
from sft_trainer.cli import main as run_main
from sft_trainer.config import (
    LINEAR_NAMES,
    LoraConfig,
    ModelConfig,
    load_config,
    resolve_model_config,
    tiny_nemotron_h_config,
    tiny_qwen35_config,
)
from sft_trainer.lora import apply_lora

SHAPES = ("qwen3_5-0.8b", "qwen3_5-2b", "qwen3_5-35b-a3b", "nemotron_h-nano-30b-a3b")
GIB = 2**30


def shipped(name: str):
    hf = resolve_model_config(ModelConfig(config=name))
    return hf if hf.model_type == "nemotron_h" else load_text_config(hf)


def tiny_qwen35_moe_config():
    from transformers import Qwen3_5MoeTextConfig

    base = _without(tiny_qwen35_config(vocab_size=96), "intermediate_size")
    base.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40)
    return Qwen3_5MoeTextConfig(**base)


def _without(config, *keys) -> dict:
    out = config.to_dict()
    for key in ("model_type", "architectures", "transformers_version", "dtype", *keys):
        out.pop(key, None)
    return out


def tiny_configs():
    from transformers import NemotronHConfig, Qwen3_5TextConfig

    qwen = _without(tiny_qwen35_config(vocab_size=96))
    nemotron = _without(tiny_nemotron_h_config(vocab_size=80), "layers_block_type")
    return {
        "qwen3_5 dense": tiny_qwen35_config(vocab_size=96),
        "qwen3_5 dense, attention bias, untied": Qwen3_5TextConfig(
            **{**qwen, "attention_bias": True, "tie_word_embeddings": False}
        ),
        "qwen3_5 moe": tiny_qwen35_moe_config(),
        "nemotron_h": tiny_nemotron_h_config(vocab_size=80),
        "nemotron_h latent MoE, biases": NemotronHConfig(
            **{
                **nemotron,
                "hybrid_override_pattern": "ME*-M",
                "moe_latent_size": 16,
                "use_bias": True,
                "mlp_bias": True,
                "use_conv_bias": False,
            }
        ),
    }


def meta_model(config):
    with torch.device("meta"):
        if config.model_type == "nemotron_h":
            return NemotronHForCausalLM(config)
        return Qwen35ForCausalLM(config)


# --------------------------------------------------------------------------------------------------------
# Parameters


@pytest.mark.parametrize("name", SHAPES)
def test_parameter_counts_equal_the_meta_model_for_shipped_shapes(name):
    config = shipped(name)
    counted = plan.count_parameters(config)
    assert counted.total == sum(p.numel() for p in meta_model(config).parameters())
    assert counted.total == counted.embeddings + sum(counted.layers.values())


@pytest.mark.parametrize("name", list(tiny_configs()))
def test_parameter_and_lora_counts_equal_the_meta_model_for_tiny_configs(name):
    config = tiny_configs()[name]
    model = meta_model(config)
    assert plan.count_parameters(config).total == sum(p.numel() for p in model.parameters())
    family = "nemotron_h" if config.model_type == "nemotron_h" else "qwen3_5"
    for targets in (LoraConfig().targets, list(LINEAR_NAMES[family])):
        targets = [t for t in targets if t in LINEAR_NAMES[family]]
        lora_model = meta_model(config)
        apply_lora(lora_model, targets, rank=4, alpha=8.0)
        adapters = sum(p.numel() for n, p in lora_model.named_parameters() if "lora_" in n)
        counted = plan.count_parameters(config, lora_targets=targets, lora_rank=4)
        assert counted.lora == adapters, targets
        assert counted.trainable == adapters


def test_the_largest_block_is_the_largest_decoder_layer():
    for config in (shipped("qwen3_5-35b-a3b"), shipped("nemotron_h-nano-30b-a3b"), *tiny_configs().values()):
        model = meta_model(config)
        largest = max(sum(p.numel() for p in layer.parameters()) for layer in model.decoder_layers())
        assert plan.count_parameters(config).largest_block == largest


# --------------------------------------------------------------------------------------------------------
# Bytes: closed forms vs what one layer sends on a fake process group (every rank; the busiest counts)


def _sent(make_inputs, rank: int, cp: int, seq_len: int, recompute: bool, attention_cp: str = "auto") -> int:
    """Bytes ``rank`` sends while the layer runs forward + backward (under activation checkpointing: recompute)."""
    with fake_process_group(rank, cp):
        torch.manual_seed(0)
        meta = build_packed_metadata([seq_len], rank, cp)  # one document spanning the row
        module, inputs = make_inputs(meta)
        if any(isinstance(m, ContextParallelModule) for m in module.modules()):
            set_context_parallel_attributes(
                module, CPTopology.from_group(dist.group.WORLD), attention_cp_style=attention_cp
            )
        with CommCounter(cp) as counter:
            out = checkpoint(module, *inputs, use_reentrant=False) if recompute else module(*inputs)
            out.float().sum().backward()
        return counter.total_sent_bytes


def busiest_rank_bytes(make_inputs, cp: int, seq_len: int, recompute: bool = False, attention_cp: str = "auto") -> int:
    return max(_sent(make_inputs, r, cp, seq_len, recompute, attention_cp) for r in range(cp))


def _qwen_layer(config, index: int, dtype):
    def make(meta):
        layer = Qwen35DecoderLayer(config, index, "torch", "torch").to(dtype)
        rotary = Qwen35Rotary(config)(meta.local_position_ids, dtype)
        hidden = torch.randn(meta.local_len, config.hidden_size, dtype=dtype, requires_grad=True)
        return layer, (hidden, rotary, meta)

    return make


def _nemotron_block(config, index: int, style: str):
    def make(meta):
        block = NemotronHBlock(config, index, "torch", "torch", style).to(torch.bfloat16)
        hidden = torch.randn(meta.local_len, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        return block, (hidden, meta)

    return make


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_qwen35_layer_bytes_equal_the_closed_forms(cp, dtype):
    """Tiny Qwen3.5 decoder layers (GDN + MLP, attention + MLP with 2 KV heads, so replicated at cp 4, GDN + MoE)
    forward + backward; with activation checkpointing the forward's collectives are sent again."""
    elem = torch.tensor([], dtype=dtype).element_size()
    seq_len = 16 * cp
    dense, moe = tiny_qwen35_config(vocab_size=96), tiny_qwen35_moe_config()
    for recompute in (False, True):
        gdn = busiest_rank_bytes(_qwen_layer(dense, 0, dtype), cp, seq_len, recompute)
        assert gdn == plan.gdn_bytes(dense, seq_len, cp, elem, recompute=recompute) > 0
        gdn_moe = busiest_rank_bytes(_qwen_layer(moe, 0, dtype), cp, seq_len, recompute)
        assert gdn_moe == plan.gdn_bytes(moe, seq_len, cp, elem, recompute=recompute)  # the MoE sends nothing
        attention = busiest_rank_bytes(_qwen_layer(dense, 3, dtype), cp, seq_len, recompute)
        expected = plan.ulysses_attention_bytes(
            seq_len, cp, dense.num_attention_heads, dense.num_key_value_heads, dense.head_dim, elem, recompute=recompute
        )
        assert attention == expected > 0
        heads = (dense.num_attention_heads, dense.num_key_value_heads, dense.head_dim, elem)
        gathered = busiest_rank_bytes(_qwen_layer(dense, 3, dtype), cp, seq_len, recompute, "kv_gather")
        assert gathered == plan.kv_gather_attention_bytes(seq_len, cp, *heads, recompute=recompute) > 0
        ring = busiest_rank_bytes(_qwen_layer(dense, 3, dtype), cp, seq_len, recompute, "kv_ring")
        assert ring == plan.kv_ring_attention_bytes(seq_len, cp, *heads, recompute=recompute) > gathered


@pytest.mark.parametrize("cp", [2, 4])
def test_nemotron_h_layer_bytes_equal_the_closed_forms(cp):
    """Tiny Nemotron-H blocks "M*M-E" (n_groups 2: split at cp 2, replicated at cp 4), both Mamba styles, bf16."""
    config = tiny_nemotron_h_config(vocab_size=80)
    seq_len = 16 * cp
    assert config.n_groups < 4
    for recompute in (False, True):
        for style in ("state_passing", "a2a"):
            sent = busiest_rank_bytes(_nemotron_block(config, 0, style), cp, seq_len, recompute)
            assert sent == plan.mamba_bytes(config, style, seq_len, cp, 2, recompute=recompute) > 0, style
        attention = busiest_rank_bytes(_nemotron_block(config, 1, "state_passing"), cp, seq_len, recompute)
        expected = plan.ulysses_attention_bytes(
            seq_len, cp, config.num_attention_heads, config.num_key_value_heads, config.head_dim, 2, recompute=recompute
        )
        assert attention == expected > 0
        block = _nemotron_block(config, 1, "state_passing")
        gathered = busiest_rank_bytes(block, cp, seq_len, recompute, "kv_gather")
        q, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        assert gathered == plan.kv_gather_attention_bytes(seq_len, cp, q, kv, d, 2, recompute=recompute) > 0
        ring = busiest_rank_bytes(block, cp, seq_len, recompute, "kv_ring")
        assert ring == plan.kv_ring_attention_bytes(seq_len, cp, q, kv, d, 2, recompute=recompute) > 0
    for index in (3, 4):  # MLP, MoE: token-wise
        assert busiest_rank_bytes(_nemotron_block(config, index, "state_passing"), cp, seq_len) == 0


def test_closed_forms_match_the_documented_tables():
    """docs/cp-models.md (Nemotron-H Nano Mamba-2 at S = 32k, bf16) and benchmarks/ulysses_bytes.py's closed form."""
    nano = shipped("nemotron_h-nano-30b-a3b")
    mib = [round(plan.mamba_bytes(nano, s, 32768, cp) / 2**20, 1) for s in ("a2a",) for cp in (2, 4, 8, 16)]
    assert mib == [322.0, 241.5, 140.9, 90.5]
    assert [round(plan.mamba_bytes(nano, "state_passing", 32768, cp) / 2**20, 2) for cp in (2, 4, 16)] == [
        2.04,
        4.07,
        4.07,
    ]
    assert plan.ulysses_attention_bytes(32768, 1, 8, 2, 256) == plan.gdn_bytes(shipped("qwen3_5-0.8b"), 32768, 1) == 0
    # 0.8B attention at cp 2: 2 * 16384 * (16 + 4) * 256 * 2 * 1/2 bytes
    assert plan.ulysses_attention_bytes(32768, 2, 8, 2, 256, 2) == 2 * 16384 * 20 * 256 * 2 // 2


def test_attention_strategy_beyond_the_query_heads():
    """0.8B (8 query, 2 KV heads): Ulysses up to cp 8; beyond it "auto" gathers the keys and values (from cp 32 it
    passes them around the ring), and the estimate holds the gathered row's k|v (2 Hkv D cp per local token)
    instead of the head-layout q, k, v."""
    config = shipped("qwen3_5-0.8b")
    strategies = [plan.attention_strategy(config, cp, "auto") for cp in (1, 8, 16, 31, 32, 64)]
    assert strategies == ["ulysses"] * 2 + ["kv_gather"] * 2 + ["kv_ring"] * 2
    assert plan.valid_cp(config, 16, attention_cp="auto") is None
    assert plan.valid_cp(config, 64, attention_cp="kv_gather") is None
    assert "cp=16, q_heads=8" in plan.valid_cp(config, 16)  # Ulysses, the default
    for cp in (2, 16):
        ulysses = plan.layer_widths(config, cp, attention_cp="ulysses") if cp <= 8 else None
        gathered = plan.layer_widths(config, cp, attention_cp="kv_gather")
        assert gathered["attn_gathered"] == 8 * 256 and gathered["attn_kv_row"] == 2 * 2 * cp * 256
        assert gathered["attn_q_cp"] == 0
        if ulysses:
            assert ulysses["attn_gathered"] == (8 + 2 * max(2, cp)) * 256 and ulysses["attn_q_cp"] == 8 * 256
            assert ulysses["attn_kv_row"] == 0
        ring = plan.layer_widths(config, cp, attention_cp="kv_ring")
        assert ring["attn_gathered"] == (8 + 2 * 2) * 256 and ring["attn_kv_blocks"] == 16 * 2 * 256
        assert ring["attn_kv_row"] == ring["attn_q_cp"] == gathered["attn_kv_blocks"] == 0
    assert plan.attention_strategy(config, 64, "kv_ring") == "kv_ring"
    nano = shipped("nemotron_h-nano-30b-a3b")
    assert plan.attention_strategy(nano, 64, "auto") == "kv_ring"
    assert plan.attention_strategy(nano, 32, "auto") == "ulysses"


def test_kv_gather_keeps_the_gathered_row_alive_on_every_rank():
    """The planner's kv_gather width counts the whole gathered k|v buffer, [S, 2 Hkv, D], on every rank: the
    attention saves views of it (the first rank's keys are only its own shard, yet the buffer is one tensor)."""
    config = tiny_qwen35_config()
    cp, seq_len = 4, 64
    gathered_bytes = seq_len * 2 * config.num_key_value_heads * config.head_dim * 2
    for rank in range(cp):
        sizes = set(_attention_saved_storages(config, rank, cp, seq_len // cp, "kv_gather").values())
        assert gathered_bytes in sizes, (rank, sorted(sizes))


def _attention_saved_storages(config, rank: int, cp: int, local: int, style: str) -> dict[int, int]:
    """The storages autograd keeps for backward of one Qwen3.5 attention layer (bf16, torch paths) on ``rank`` of a
    fake group of ``cp`` ranks, one document spanning the row (``cp_core.testing.saved_storages``)."""
    from cp_core.testing import saved_storages
    from cp_models.qwen3_5 import Qwen35Attention

    attention = Qwen35Attention(config, "torch", "torch").to(torch.bfloat16)
    with fake_process_group(rank, cp) as group:
        set_context_parallel_attributes(attention, CPTopology.from_group(group), attention_cp_style=style)
        meta = build_packed_metadata([cp * local], rank, cp)
        x = torch.randn(local, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        rotary = Qwen35Rotary(config)(meta.local_position_ids, torch.bfloat16)
        _, storages = saved_storages(lambda: attention(x, rotary, meta))
    return storages


def _attention_saved_bytes(config, rank: int, cp: int, local: int, style: str) -> int:
    return sum(_attention_saved_storages(config, rank, cp, local, style).values())


def test_kv_ring_keeps_the_same_bytes_at_any_cp():
    """The planner's ring model (attn_kv_row 0): an attention layer under kv_ring keeps the same bytes for backward
    on the last rank at cp 4 and 16 for the same tokens a rank, where kv_gather's grow by at least the row's extra
    k|v (on these CPU torch paths also by the reference kernel's probabilities over the longer key range)."""
    config = tiny_qwen35_config()
    local, kv_token = 16, 2 * config.num_key_value_heads * config.head_dim * 2
    ring = {cp: _attention_saved_bytes(config, cp - 1, cp, local, "kv_ring") for cp in (4, 16)}
    gathered = {cp: _attention_saved_bytes(config, cp - 1, cp, local, "kv_gather") for cp in (4, 16)}
    assert ring[4] == ring[16] < gathered[4], (ring, gathered)
    assert gathered[16] - gathered[4] >= (16 - 4) * local * kv_token, gathered


def test_does_not_fit_suggests_the_ring(capsys):
    """0.8B, 2M tokens over cp 64 with all-gathered KV and checkpointing, on a GPU between the two estimates: the
    message proposes kv_ring with its estimate."""
    config = shipped("qwen3_5-0.8b")
    seq_len, cp = 2097152, 64

    def need(attention_cp):
        kw = dict(activation_checkpointing=True, fsdp_world=cp, attention_cp=attention_cp)
        return plan.estimate_memory(config, seq_len, cp, **kw).needed / GIB

    gpu = round((need("kv_gather") + need("kv_ring")) / 2, 1)
    assert need("kv_ring") < gpu < need("kv_gather")
    args = ("--data.seq_len", str(seq_len), "--parallel.cp", str(cp), "--model.activation_checkpointing", "true")
    message = _does_not_fit(capsys, *args, "--gpu-memory-gib", str(gpu), "--parallel.attention_cp", "kv_gather")
    assert f"set parallel.attention_cp = 'kv_ring' (then {need('kv_ring'):.1f} GiB)" in message, message
    # Below the ring's estimate too: not the ring alone, but the ring with twice the ranks.
    message = _does_not_fit(
        capsys, *args, "--gpu-memory-gib", str(round(need("kv_ring") - 1, 1)), "--parallel.attention_cp", "kv_gather"
    )
    assert "set parallel.attention_cp = 'kv_ring' (then" not in message
    assert "; set parallel.attention_cp = 'kv_ring' and raise parallel.cp to 128 (then" in message, message


# --------------------------------------------------------------------------------------------------------
# Memory and the longest row


REPO = Path(__file__).resolve().parents[3]


def _recorded_h200_peaks() -> list[tuple[str, int, int, bool, float, int | None, str]]:
    """Every current cp_models peak recorded on the H200 (docs/benchmarks/*.json): (shape, S, cp, checkpointing,
    GiB, simulated rank, attention strategy). Rows that measured code since changed in what they keep carry a
    "superseded" status and are left out. Simulated rows name their rank (rows without one were rank cp // 2) and
    the attention strategy the model resolved (rows without one ran Ulysses)."""
    points = []
    for row in json.loads((REPO / "docs/benchmarks/model_step.json").read_text())["rows"]:
        if row["variant"].startswith("cp_models") and row.get("status") == "ok":
            ckpt = "ckpt" in row["variant"]
            points.append((row["shape"], row["seq_len"], 1, ckpt, row["peak_gib"], None, "ulysses"))
    for path in sorted((REPO / "docs/benchmarks").glob("simulated_scale_*.json")):
        for row in json.loads(path.read_text())["rows"]:
            if row.get("status") == "ok" and row.get("peak_gib"):
                ckpt = row["variant"].endswith("act. ckpt")
                rank = row.get("rank", row["cp"] // 2) if row["cp"] > 1 else None
                attention = row.get("attention") or "ulysses"
                points.append((row["shape"], row["seq_len"], row["cp"], ckpt, row["peak_gib"], rank, attention))
    return points


@functools.cache
def _benchmark_shape(name: str):
    """The transformers config of a benchmark shape, from benchmarks/model_step.py's own loader."""
    spec = importlib.util.spec_from_file_location("model_step", REPO / "benchmarks/model_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.load_shape(name)


def _benchmark_shapes(names) -> dict:
    return {name: _benchmark_shape(name) for name in names}


RECORDED_PEAKS = _recorded_h200_peaks()


def test_the_recorded_peaks_cover_every_shape_and_strategy():
    """The whole-step memory test below sees every benchmark shape unsharded with and without checkpointing, and
    one rank's share from cp 8 to 64 under Ulysses, all-gathered KV and ring-passed KV."""
    shapes = {p[0] for p in RECORDED_PEAKS}
    assert {"qwen3_5-0.8b", "qwen3_5-2b", "nemotron_h-nano-8l", "qwen3_5-35b-a3b-8l"} <= shapes
    assert sum(p[2] == 1 for p in RECORDED_PEAKS) >= 14
    assert {p[2] for p in RECORDED_PEAKS if p[6] == "ulysses"} >= {1, 8}
    assert {p[2] for p in RECORDED_PEAKS if p[6] == "kv_gather"} >= {16, 32, 64}
    assert {p[2] for p in RECORDED_PEAKS if p[6] == "kv_ring"} >= {16, 32, 64}


@pytest.mark.parametrize(
    "point",
    RECORDED_PEAKS,
    ids=[f"{p[0]}-S{p[1]}-cp{p[2]}-{'ckpt' if p[3] else 'full'}-{p[6]}" for p in RECORDED_PEAKS],
)
def test_memory_model_is_within_fifteen_percent_of_a_recorded_h200_peak(point):
    """The planner's per-rank total (weights, gradients, activations, workspace; no optimizer: the benchmarks'
    setting) against torch.cuda.max_memory_allocated of one recorded step: unsharded (8k to 128k tokens, with and
    without checkpointing) or one rank's share at cp 8 .. 64 on a fake group, estimated for the rank and attention
    strategy it ran (at cp >= 4 a middle rank, through which the state passes)."""
    shape, seq_len, cp, ckpt, measured, rank, attention = point
    est = plan.estimate_memory(
        _benchmark_shape(shape), seq_len, cp, activation_checkpointing=ckpt, optimizer=False, rank=rank,
        attention_cp=attention,
    )  # fmt: skip
    assert est.total / GIB == pytest.approx(measured, rel=0.15), (est.total / GIB, measured)


def test_the_busiest_rank_is_the_largest_estimate():
    """The default estimate (rank None) is the busiest rank's: at least every single rank's. For Qwen3.5 the ranks
    that run GDN's pre-pass (0 .. cp-2) keep its g; the segmented pre-pass keeps nothing else of its own, so they
    estimate alike, K identity columns or not; the last rank keeps less."""
    config = shipped("qwen3_5-0.8b")
    kw = dict(activation_checkpointing=True, optimizer=False)
    for cp in (2, 4, 8):
        busiest = plan.estimate_memory(config, 65536 * cp, cp, **kw).total
        ranks = [plan.estimate_memory(config, 65536 * cp, cp, rank=r, **kw).total for r in range(cp)]
        assert busiest == max(ranks) == ranks[0] >= ranks[-1]
        assert len(set(ranks[:-1])) == 1
        # At cp 8 the attention layer (KV replicated to 8 heads) is every rank's largest, so the last rank ties.
        assert ranks[0] > ranks[-1] or cp == 8
    with pytest.raises(ValueError, match="rank=4 is not a rank of cp=4"):
        plan.estimate_memory(config, 4096, 4, activation_checkpointing=True, rank=4)


def test_loss_and_moe_parts_are_within_five_percent_of_their_recorded_h200_peaks():
    """The two parts the whole-step test cannot see apart, each measured alone on the H200
    (docs/benchmarks/loss_moe_memory.json): the tiled loss's backward workspace at the tile it ran and the MoE
    block's saved activations plus its output, against what the current planner says for them."""
    rows = json.loads((REPO / "docs/benchmarks/loss_moe_memory.json").read_text())["rows"]
    configs = _benchmark_shapes({r["shape"] for r in rows})
    kinds = set()
    for row in rows:
        config = configs[row["shape"]]
        if row["part"].startswith("loss"):
            tile = tuple(row["tile"])
            planned = plan.loss_workspace_bytes(config.vocab_size, config.hidden_size, row["tokens"], 2, tile)
        else:
            per_token = plan.activation_bytes_per_token(config, 1)["moe"]["saved"] + config.hidden_size * 2
            planned = row["tokens"] * per_token
        kinds.add((row["part"].split()[0], row["shape"]))
        assert planned / GIB == pytest.approx(row["measured_gib"], rel=0.05), row
    assert {("loss", "qwen3_5-0.8b"), ("loss", "nemotron_h-nano-8l"), ("moe", "qwen3_5-35b-a3b-8l"),
            ("moe", "nemotron_h-nano-8l")} <= kinds  # fmt: skip


@pytest.mark.parametrize(
    ("tokens", "vocab", "weight_grad"),
    [(2048, 3000, True), (6000, 2048, True), (9000, 20000, True), (20000, 9000, True), (9000, 20000, False)],
)
def test_loss_workspace_equals_the_live_bytes_of_the_tiled_loss(tokens, vocab, weight_grad):
    """The planner's loss workspace against the peak of live tensor bytes during one forward + backward of
    token_log_probs in bf16 on the CPU (torch's MemTracker, inputs left out), both loop orders (fewer tokens than
    vocabulary and more), tiles clipped by either size, and a frozen LM head (LoRA). The CPU bf16 path holds what the
    CUDA one does at its peak: an fp32 tile and its bf16 copy."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from cp_models import token_log_probs

    hidden_size = 64
    gen = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, hidden_size, generator=gen).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(vocab, hidden_size, generator=gen).to(torch.bfloat16).requires_grad_(weight_grad)
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    tracker = MemTracker()
    with tracker:
        token_log_probs(hidden, weight, labels).sum().backward()
    peak = sum(device["Total"] for device in tracker.get_tracker_snapshot("peak").values())
    inputs = (tokens + vocab) * hidden_size * 2 + tokens * 8
    planned = plan.loss_workspace_bytes(vocab, hidden_size, tokens, 2, weight_grad=weight_grad)
    assert planned == pytest.approx(peak - inputs, rel=0.05), (planned, peak - inputs)
    assert (weight.grad is not None) == weight_grad and hidden.grad is not None


def _bytes_saved_for_backward(module: torch.nn.Module, run) -> int:
    """Bytes of the distinct storages autograd keeps for backward after ``run()``, parameters left out.

    Only what is still saved once ``run()`` returns counts: a branch whose output is dropped mid-run (the torch SSD
    reference's final state at cp = 1) frees its saved tensors, and the allocator may hand their addresses to later
    ones, so keying storages by address while they come and go would count by the allocator's luck."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    packed = []

    def pack(t):
        packed.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = run()
    alive = (ref() for ref in packed)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in alive if t is not None}
    del output
    return sum(nbytes for ptr, nbytes in storages.items() if ptr not in params)


@pytest.mark.skipif(not hasattr(torch.nn.functional, "grouped_mm"), reason="torch without grouped_mm")
@pytest.mark.parametrize("lora_down", [False, True], ids=["full", "lora_down_proj"])
@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_moe_saved_bytes_equal_what_autograd_saves_on_the_grouped_path(family, lora_down):
    """The MoE's "saved" coefficients against the bytes autograd keeps for backward on the grouped-GEMM path
    (the CUDA bf16 path; grouped_mm also runs on CPU), per token: the slope between two lengths, so per-call
    constants (the fp32 router weight) drop out. With a LoRA adapter on down_proj the shared expert runs the plain
    MLP expression, which keeps more (the planner's ``plain_mlp``); the adapter's own rank-1 activations are
    within the tolerance."""
    from cp_models.nemotron_h import NemotronHMoE
    from cp_models.qwen3_5 import Qwen35SparseMoeBlock

    if family == "qwen3_5":
        config = tiny_qwen35_moe_config()
        block = Qwen35SparseMoeBlock(config)
    else:
        config = tiny_nemotron_h_config()
        block = NemotronHMoE(config)
    block = block.to(torch.bfloat16)
    if lora_down:
        from sft_trainer.lora import apply_lora

        assert apply_lora(block, ["down_proj"], rank=1, alpha=1.0) == 1  # the shared expert's (experts: stacked)
        block.requires_grad_(True)  # as full fine-tuning counts (frozen weights keep less: the upper bound)
    for module in block.modules():
        if hasattr(module, "_grouped"):  # what forward picks on CUDA bf16
            module.forward = module._grouped

    def saved_bytes(tokens: int) -> int:
        torch.manual_seed(0)
        x = torch.randn(tokens, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        return _bytes_saved_for_backward(block, lambda: block(x))

    counted = (saved_bytes(512) - saved_bytes(256)) / 256
    planned = plan.activation_bytes_per_token(config, 1, plain_mlp=lora_down)["moe"]["saved"]
    assert planned == pytest.approx(counted, rel=0.03), (planned, counted)


def test_mamba_state_passing_correction_saves_what_the_planner_counts():
    """The extra bytes a Mamba-2 layer keeps for backward under state passing at cp > 1 (ssd_cp's first-document
    correction), per token: autograd's saved bytes of a mixer as rank 1 of a fake group of 2 minus the unsharded
    mixer's, as a slope between two lengths (the halo and the passed state are per-call constants). Both lengths
    span 2+ chunks of the torch SSD reference (64 tokens): at cp = 1 its last chunk's final-state terms are dropped
    unless they share a storage with earlier chunks' (a per-call constant then, not one at a single chunk)."""
    from cp_models import set_context_parallel_attributes
    from cp_models.nemotron_h_mamba import NemotronHMamba2Mixer

    config = tiny_nemotron_h_config()
    torch.manual_seed(0)
    # bf16, as on the GPU: there the correction's fp32 copy of C is a tensor of its own.
    mixer = NemotronHMamba2Mixer(config, recurrent_backend="torch", cp_style="state_passing").to(torch.bfloat16)

    def saved_bytes(tokens: int, cp: int) -> int:
        rank = min(1, cp - 1)
        with fake_process_group(rank, cp) as group:
            if cp > 1:
                set_context_parallel_attributes(mixer, CPTopology.from_group(group))
            meta = build_packed_metadata([tokens * cp], rank, cp)
            x = torch.randn(tokens, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
            saved = _bytes_saved_for_backward(mixer, lambda: mixer(x, meta))
            if cp > 1:
                set_context_parallel_attributes(mixer, CPTopology.single())
            return saved

    def slope(cp: int) -> float:
        return (saved_bytes(256, cp) - saved_bytes(128, cp)) / 128

    counted = slope(2) - slope(1)
    per_token = {cp: plan.activation_bytes_per_token(config, cp)["mamba"]["saved"] for cp in (1, 2)}
    print("COUNTED", per_token, counted)
    assert per_token[2] - per_token[1] == pytest.approx(counted, rel=0.02), (per_token, counted)
    assert counted > 0


def test_memory_breakdown_follows_the_trainer_layout():
    config = shipped("qwen3_5-2b")
    p = plan.count_parameters(config)
    kw = dict(activation_checkpointing=False, dtype="bfloat16")
    replica = plan.estimate_memory(config, 8192, 2, fsdp=False, **kw)
    assert (replica.parameters, replica.gradients, replica.optimizer) == (2 * p.total, 2 * p.total, 4 * p.total)
    sharded = plan.estimate_memory(config, 8192, 2, fsdp_world=4, **kw)
    assert sharded.optimizer == 8 * p.total // 4  # fp32 exp_avg + exp_avg_sq, 1/4 each
    assert sharded.parameters == int(p.total * 4 / 4 + (p.embeddings + plan.FSDP_GATHERED_BLOCKS * p.largest_block) * 2)
    lora = plan.estimate_memory(config, 8192, 2, fsdp_world=4, lora=True, **kw)
    assert 0 < lora.optimizer < sharded.optimizer / 100 and lora.gradients < sharded.gradients
    assert lora.activations == sharded.activations
    # checkpointing keeps one hidden state per layer
    ckpt = plan.estimate_memory(config, 8192, 2, fsdp_world=4, **{**kw, "activation_checkpointing": True})
    model_saved = ckpt.per_token["model"]["saved"]
    assert ckpt.activations == int(4096 * (config.num_hidden_layers * config.hidden_size * 2 + model_saved))
    assert ckpt.activations < sharded.activations / 10
    # the loss over 4096 local tokens (fewer than the vocabulary): one fp32 + one bf16 tile of 4096 x 8192, the
    # fp32 [T, hidden] accumulator, one 8192-row fp32 chunk and GEMM output, the bf16 gradients of hidden and weight
    v, h = config.vocab_size, config.hidden_size
    assert sharded.loss_workspace == 4096 * 8192 * 6 + 4096 * h * 4 + 2 * 8192 * h * 4 + (4096 + v) * h * 2


def test_every_coefficient_width_is_defined():
    for config in [shipped(n) for n in SHAPES] + list(tiny_configs().values()):
        for cp in (1, 2, 4):
            for style in ("state_passing", "a2a"):
                per_token = plan.activation_bytes_per_token(config, cp, 2, style)
                assert all(v["saved"] > 0 for k, v in per_token.items()), per_token


@pytest.mark.parametrize("name", SHAPES)
def test_longest_seq_len_is_tight_and_monotonic(name):
    config = shipped(name)
    capacity = plan.H200_GIB
    previous = {False: 0, True: 0}
    for cp in (1, 2, 4, 8):
        if plan.valid_cp(config, cp):
            continue
        for ckpt in (False, True):
            kw = dict(activation_checkpointing=ckpt, fsdp_world=cp, fsdp=True)
            longest = plan.longest_seq_len(config, cp, capacity, **kw)
            assert longest % cp == 0 and longest >= previous[ckpt], (cp, ckpt, longest, previous)
            previous[ckpt] = longest
            if longest:
                assert plan.estimate_memory(config, longest, cp, **kw).needed <= capacity * GIB
            assert plan.estimate_memory(config, longest + cp, cp, **kw).needed > capacity * GIB
        no_ckpt = plan.longest_seq_len(config, cp, capacity, activation_checkpointing=False, fsdp_world=cp)
        assert plan.longest_seq_len(config, cp, capacity, activation_checkpointing=True, fsdp_world=cp) >= no_ckpt
    assert previous[True] > 0  # some cp fits every shipped shape at 8 ranks with checkpointing


def test_longest_seq_len_respects_the_conv_halo():
    config = tiny_qwen35_config(vocab_size=96)
    # at cp 4 the shortest row is 4 * (W - 1) = 12 tokens; with room for nothing more it is 0
    tiny_need = plan.estimate_memory(config, 12, 4, activation_checkpointing=False, fsdp_world=4).needed / GIB
    assert plan.longest_seq_len(config, 4, tiny_need, fsdp_world=4, activation_checkpointing=False) >= 12
    assert plan.longest_seq_len(config, 4, tiny_need * 0.99, fsdp_world=4, activation_checkpointing=False) == 0


# --------------------------------------------------------------------------------------------------------
# The CLI


def run_plan(capsys, *args):
    run_main(["plan", *args])
    return capsys.readouterr().out


def test_cli_prints_the_table(capsys):
    out = run_plan(capsys, "--config", "tiny_cpu")
    config = tiny_qwen35_config(vocab_size=plan.tokenizer_vocab(str(load_config("tiny_cpu").tokenizer_path)))
    assert "sft-train plan: tiny-qwen3_5 (qwen3_5_text)" in out
    assert f"{plan.count_parameters(config).total:,} parameters" in out
    gdn = plan.gdn_bytes(config, 256, 2, 4)
    row = re.search(r"linear_attention \(Gated DeltaNet\)\s+3\s+conv halo \+ delta-rule state passing\s+(\S+ \S+)", out)
    assert row and row.group(1) == plan.format_size(gdn)
    assert re.search(r"full_attention \(gated softmax attention\)\s+1\s+Ulysses all-to-all, KV heads x1", out)
    assert re.search(r"mlp \(SwiGLU MLP\)\s+4\s+local", out)
    assert "Memory per rank (GiB)" in out and "Longest data.seq_len that fits" in out
    assert "attention_cp=ulysses, FSDP2 over 2 ranks" in out  # the strategy is named only when "auto" chose it
    # 4 query heads: Ulysses (the default) cannot run cp 8; "auto" gathers the keys and values there.
    assert "not valid: Ulysses attention needs cp to divide the query heads: cp=8, q_heads=4" in out
    out = run_plan(capsys, "--config", "tiny_cpu", "--parallel.attention_cp", "auto")
    assert "attention_cp=auto (ulysses)" in out
    assert re.search(r"\n\s+8\s+\d+\s+\d+\n", out) and "not valid" not in out
    # The ring: its strategy, bytes and share in the table, every cp valid.
    out = run_plan(capsys, "--config", "tiny_cpu", "--parallel.attention_cp", "kv_ring")
    config = tiny_qwen35_config(vocab_size=plan.tokenizer_vocab(str(load_config("tiny_cpu").tokenizer_path)))
    ring = plan.kv_ring_attention_bytes(
        256, 2, config.num_attention_heads, config.num_key_value_heads, config.head_dim, 4
    )
    assert "attention_cp=kv_ring, FSDP2" in out and "not valid" not in out
    row = re.search(
        r"full_attention \(gated softmax attention\)\s+1\s+ring of K\|V blocks, query halves swapped\s+(\S+ \S+)", out
    )
    assert row and row.group(1) == plan.format_size(ring)
    assert re.search(r"all-gather 0\.0%, ring \d+\.\d%", out)


def test_cli_json_parses_and_agrees_with_the_closed_forms(capsys):
    out = run_plan(
        capsys,
        "--model.config",
        "qwen3_5-0.8b",
        "--config",
        "tiny_cpu",
        "--model.dtype",
        "bfloat16",
        "--data.seq_len",
        "32768",
        "--parallel.cp",
        "4",
        "--json",
        "--nvlink-gbps",
        "300",
        "--gpu-memory-gib=80",
    )
    result = json.loads(out)
    config = shipped("qwen3_5-0.8b")
    comm = result["communication"]
    gdn, attn = plan.gdn_bytes(config, 32768, 4), plan.ulysses_attention_bytes(32768, 4, 8, 2, 256)
    assert comm["bytes_per_row"] == 18 * gdn + 6 * attn
    assert comm["state_passing_bytes"] == 18 * gdn and comm["all_to_all_bytes"] == 6 * attn
    assert comm["time_ms_per_row"] == pytest.approx((18 * gdn + 6 * attn) / 300e9 * 1e3)
    assert result["gpu_memory_gib"] == 80 and result["fits"] and result["problems"] == []
    assert result["model"]["parameters"] == 752393024
    est = plan.estimate_memory(config, 32768, 4, activation_checkpointing=False, fsdp_world=4)
    assert result["memory"]["no_checkpointing"]["needed"] == pytest.approx(est.needed / GIB)
    longest = result["longest_seq_len"]["4"]
    assert longest["no_checkpointing"] == plan.longest_seq_len(
        config, 4, 80, activation_checkpointing=False, fsdp_world=4
    )
    assert {r["kind"]: r["count"] for r in result["layers"]} == {"gdn": 18, "attention": 6, "mlp": 24}


def test_nemotron_a2a_plan_names_the_replicated_groups(capsys):
    out = run_plan(
        capsys,
        "--config",
        "tiny_cpu",
        "--model.preset",
        "tiny-nemotron_h",
        "--parallel.cp",
        "4",
        "--parallel.cp_style",
        "a2a",
        "--json",
    )
    rows = {r["kind"]: r for r in json.loads(out)["layers"]}
    assert rows["mamba"]["strategy"] == "head-parallel all-to-all, n_groups 2 -> 4 replicated"
    assert rows["mamba"]["count"] == 2 and rows["moe"]["bytes"] == rows["mlp"]["bytes"] == 0


@pytest.mark.parametrize(
    ("overrides", "parts"),
    [
        (
            ["--parallel.cp", "3", "--data.seq_len", "258"],
            [
                "parallel.cp=3 with parallel.attention_cp='ulysses' vs the attention heads of model.preset='tiny-qwen3_5'",
                "num_attention_heads=4",
                "Ulysses attention needs cp to divide the query heads: cp=3, q_heads=4",
            ],
        ),
        (
            ["--parallel.cp", "4", "--data.seq_len", "250"],
            ["data.seq_len=250 must be divisible by parallel.cp=4"],
        ),
        (
            ["--parallel.cp", "4", "--data.seq_len", "8"],
            ["data.seq_len=8 is too short for parallel.cp=4", "seq_len >= cp * 3 = 12"],
        ),
        (["--nvlink-gbps", "fast"], ["--nvlink-gbps takes a positive finite number, got 'fast'"]),
        (["--gpu-memory-gib", "nan"], ["--gpu-memory-gib takes a positive finite number, got 'nan'"]),
        (["--gpu-memory-gib=inf"], ["--gpu-memory-gib takes a positive finite number, got 'inf'"]),
        (["--nvlink-gbps", "0"], ["--nvlink-gbps takes a positive finite number, got '0'"]),
    ],
)
def test_invalid_configs_exit_with_the_reason(capsys, overrides, parts):
    with pytest.raises(SystemExit) as exc:
        run_main(["plan", "--config", "tiny_cpu", *overrides])
    message = str(exc.value.code)
    for part in parts:
        assert part in message, message


def _does_not_fit(capsys, *overrides):
    args = ["--config", "tiny_cpu", "--model.config", "qwen3_5-0.8b", "--model.dtype", "bfloat16", *overrides]
    with pytest.raises(SystemExit) as exc:
        run_main(["plan", *args])
    assert "DOES NOT FIT" in capsys.readouterr().out  # the table is still printed
    return str(exc.value.code)


def test_does_not_fit_suggests_checkpointing_and_a_shorter_row(capsys):
    config = shipped("qwen3_5-0.8b")
    message = _does_not_fit(capsys, "--data.seq_len", "1048576", "--parallel.cp", "2")
    kw = dict(fsdp_world=2, fsdp=True)
    need = plan.estimate_memory(config, 1048576, 2, activation_checkpointing=False, **kw).needed / GIB
    ckpt = plan.estimate_memory(config, 1048576, 2, activation_checkpointing=True, **kw).needed / GIB
    longest = plan.longest_seq_len(config, 2, plan.H200_GIB, activation_checkpointing=False, **kw)
    assert ckpt < plan.H200_GIB < need
    assert message == (
        f"sft-train plan: data.seq_len=1048576 at parallel.cp=2 does not fit: needs {need:.1f} GiB per rank, the "
        f"GPU has {plan.H200_GIB:.1f} GiB; enable model.activation_checkpointing (then {ckpt:.1f} GiB) / lower "
        f"data.seq_len to {longest}"
    )
    # With all-gathered KV allowed past the 8 query heads, the first cp that fits without checkpointing is 16.
    message = _does_not_fit(
        capsys, "--data.seq_len", "1048576", "--parallel.cp", "2", "--parallel.attention_cp", "auto"
    )
    wider = {
        cp: plan.estimate_memory(
            config, 1048576, cp, activation_checkpointing=False, fsdp_world=cp, attention_cp="auto"
        ).needed
        / GIB
        for cp in (8, 16)
    }
    assert wider[16] <= plan.H200_GIB < wider[8]
    assert f"/ raise parallel.cp to 16 (then {wider[16]:.1f} GiB) / lower data.seq_len to" in message


def test_does_not_fit_suggests_a_larger_cp(capsys):
    config = shipped("qwen3_5-0.8b")
    args = ("--data.seq_len", "4000000", "--parallel.cp", "2", "--model.activation_checkpointing", "true")

    def need(cp, attention_cp="auto"):
        kw = dict(activation_checkpointing=True, fsdp_world=cp, attention_cp=attention_cp)
        return plan.estimate_memory(config, 4000000, cp, **kw).needed / GIB

    # On a 140 GiB GPU: cp 3 does not divide the row, cp 4 is too small; cp 5 fits with all-gathered KV ("auto": 5
    # does not divide the 8 query heads), and under Ulysses (the default) the next valid cp, 8.
    gpu = 140.0
    assert need(4) > gpu >= need(5)
    for attention_cp, cp in (("auto", 5), ("ulysses", 8)):
        message = _does_not_fit(capsys, *args, "--gpu-memory-gib", str(gpu), "--parallel.attention_cp", attention_cp)
        expected = f"needs {need(2):.1f} GiB per rank, the GPU has {gpu:.1f} GiB; raise parallel.cp to {cp} (then "
        assert expected + f"{need(cp, attention_cp):.1f} GiB)" in message, message
        assert "enable model.activation_checkpointing" not in message
        assert "lower data.seq_len to" in message


def test_vl_plan_counts_the_vision_tower(capsys):
    from cp_vlm import Qwen35VLForConditionalGeneration

    result = json.loads(run_plan(capsys, "--config", "tiny_vl_cpu", "--json"))
    cfg = load_config("tiny_vl_cpu")
    vocab = plan.tokenizer_vocab(cfg.tokenizer_path)
    with torch.device("meta"):
        model = Qwen35VLForConditionalGeneration(resolve_model_config(cfg.model, vocab_size=vocab))
    assert result["model"]["parameters"] == sum(p.numel() for p in model.parameters())
    assert result["model"]["vision_parameters"] > 0 and result["notes"]


def test_lora_on_down_proj_counts_the_plain_mlp():
    """A LoRA adapter on down_proj makes the MLP run its plain expression (2 more [T, intermediate] tensors kept per
    Qwen3.5 layer); adapters elsewhere leave the recomputing MLP in place."""
    config = shipped("qwen3_5-0.8b")
    kw = dict(activation_checkpointing=False, optimizer=False, lora=True)

    def activations(targets):
        return plan.estimate_memory(config, 8192, 1, lora_targets=targets, **kw).activations

    extra = 8192 * config.num_hidden_layers * 2 * config.intermediate_size * 2
    assert activations(["q_proj", "down_proj"]) - activations(["q_proj"]) == extra
    assert activations(["q_proj", "up_proj"]) == activations(["q_proj"])


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_gpu_run_warns_before_launch_when_the_plan_does_not_fit(capsys, monkeypatch, tmp_path, rank):
    """On a GPU, `sft-train` prints the planner's reason and fixes before any weights load (rank 0 only), then
    launches anyway: the estimate is within 15 %, so a run near the limit may still fit."""
    import sft_trainer.run as run

    launched = []
    monkeypatch.setattr(run, "backend_of", lambda cfg: "nccl")
    monkeypatch.setattr(run, "launch", lambda cfg, workers=None: launched.append(cfg))
    monkeypatch.setenv("RANK", rank)
    args = ["--config", "tiny_cpu", "--model.config", "qwen3_5-0.8b", "--model.dtype", "bfloat16"]
    # Each call holds its output folder for the life of this process, as a run does: one folder per call.
    run_main([*args, "--data.seq_len", "1048576", "--parallel.cp", "2", "--output_dir", str(tmp_path / "long")])
    out = capsys.readouterr().out
    expected = plan.build_plan(load_config("tiny_cpu", [*args[2:], "--data.seq_len", "1048576", "--parallel.cp", "2"]))
    assert len(launched) == 1 and not expected["fits"]
    if rank == "0":
        assert (
            out
            == f"[sft-train] warning: likely out of memory: {expected['problems'][0]} (sft-train plan prints the estimate)\n"
        )
        assert "does not fit: needs" in out and "enable model.activation_checkpointing" in out
    else:
        assert out == ""
    run_main([*args, "--data.seq_len", "8192", "--parallel.cp", "2", "--output_dir", str(tmp_path / "short")])  # fits
    assert capsys.readouterr().out == "" and len(launched) == 2


def test_a_cpu_run_skips_the_gpu_plan(capsys, monkeypatch, tmp_path):
    import sft_trainer.cli as cli
    import sft_trainer.run as run

    monkeypatch.setattr(run, "backend_of", lambda cfg: "gloo")
    monkeypatch.setattr(run, "launch", lambda cfg, workers=None: None)
    monkeypatch.setattr(cli, "warn_when_plan_does_not_fit", lambda cfg: pytest.fail("planned a CPU run"))
    args = ["--model.config", "qwen3_5-0.8b", "--data.seq_len", "1048576", "--output_dir", str(tmp_path)]
    run_main(["--config", "tiny_cpu", *args])
    assert capsys.readouterr().out == ""


def test_a_plan_that_cannot_be_built_does_not_stop_the_run(capsys, monkeypatch):
    import sft_trainer.cli as cli
    import sft_trainer.plan

    def broken(cfg, **kwargs):
        raise KeyError("hidden_size")

    monkeypatch.setattr(sft_trainer.plan, "build_plan", broken)
    assert cli.warn_when_plan_does_not_fit(load_config("tiny_cpu")) is True
    assert (
        capsys.readouterr().out == "[sft-train] note: no memory estimate (KeyError: 'hidden_size'); starting anyway\n"
    )


def test_does_not_fit_suggests_a_combination_when_no_single_change_fits(capsys):
    """1M tokens of 0.8B on one rank: neither checkpointing nor more ranks alone fit, both together at cp 2 do."""
    config = shipped("qwen3_5-0.8b")
    message = _does_not_fit(capsys, "--data.seq_len", "1048576", "--parallel.cp", "1")

    def need(cp, ckpt):
        return plan.estimate_memory(config, 1048576, cp, activation_checkpointing=ckpt, fsdp_world=cp).needed / GIB

    assert need(1, True) > plan.H200_GIB and need(2, False) > plan.H200_GIB >= need(2, True)
    assert (
        f"; enable model.activation_checkpointing and raise parallel.cp to 2 (then {need(2, True):.1f} GiB) / "
        in message
    )
    assert "lower data.seq_len to" in message


def test_activation_coefficients_cover_exactly_the_family_specs_keys():
    """The planner's coefficient table and cp_models' family specs name the same entries (adding a family adds both)."""
    from cp_models.families import FAMILIES
    from sft_trainer.plan.coefficients import ACTIVATION_COEFFICIENTS

    assert set(ACTIVATION_COEFFICIENTS) == {key for family in FAMILIES.values() for key in family.coefficient_keys}
