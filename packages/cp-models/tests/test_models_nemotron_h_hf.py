"""Nemotron-H on CPU in fp32 against transformers' reference model.

transformers' torch fallback for Mamba-2 ignores document boundaries in a packed row, so every comparison runs our
model on a packed row and transformers' model on each document alone ([1, L_i]). Parameters are randomized on the
transformers side, saved with ``save_pretrained`` (its on-disk layout: ``backbone.`` prefix, one tensor per
expert) and loaded with our ``from_pretrained``, so the real checkpoint path is exercised by every parity test.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
import transformers
from nemotron_h_dt import draw_dt_bias
from packaging.version import Version
from transformers import AutoModelForCausalLM, LlamaConfig, NemotronHConfig
from transformers import NemotronHForCausalLM as HFNemotronH
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter as HFRouter

from cp_core import ContextParallelError
from cp_core.testing import relative_max
from cp_models import NemotronHForCausalLM, apply_activation_checkpointing, load_nemotron_h_config
from cp_models.activations import ACTIVATIONS, activation
from cp_models.hf_checkpoint import read_safetensors, write_safetensors
from cp_models.nemotron_h import NemotronHExperts, NemotronHTopkRouter
from cp_models.nemotron_h_mamba import NemotronHMamba2Mixer
from cp_models.presets import tiny_nemotron_h_config

TOL = 1e-5  # relative: max |ours - ref| / max |ref|, for logits and log-probs
GRAD_TOL = 5e-5  # parameter gradients, packed row vs the sum over documents (observed <= 3.3e-5, on A_log)

BASE = dict(  # overrides of the tiny Nemotron-H preset (cp_models.presets.TINY_NEMOTRON_H)
    vocab_size=80,
    hidden_size=32,
    head_dim=8,
    intermediate_size=48,
    mamba_num_heads=4,
    ssm_state_size=8,
    chunk_size=16,  # transformers' chunked scan: documents above 16 tokens cross its chunks
    moe_intermediate_size=16,
    moe_shared_expert_intermediate_size=24,
)

# name -> (config overrides, packed document lengths). Every row holds documents shorter than the conv width (4).
CASES = {
    "M*M-_groups2_gqa": (dict(hybrid_override_pattern="M*M-"), [7, 2, 11, 1]),
    "ME*M_groups1_moe": (dict(hybrid_override_pattern="ME*M", n_groups=1), [3, 20, 1, 6]),
    "MEM*E_grouped_routing_scaled": (
        dict(
            hybrid_override_pattern="MEM*E",
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            mamba_num_heads=8,
            mamba_head_dim=4,
            n_groups=4,
            num_key_value_heads=1,
        ),
        [2, 9, 1, 14],
    ),
    "M-E_latent_unnormalized_biases": (
        dict(
            hybrid_override_pattern="M-E",
            moe_latent_size=12,
            norm_topk_prob=False,
            use_bias=True,
            mlp_bias=True,
            use_conv_bias=False,
            ssm_state_size=4,
        ),
        [5, 3, 12],
    ),
    "MM*_long_doc_mha_gelu_conv": (
        dict(
            hybrid_override_pattern="MM*",
            num_key_value_heads=4,
            mamba_hidden_act="gelu",
            mlp_hidden_act="relu2",
            n_groups=4,
        ),
        [70, 2],  # 70 > our 64-token chunk and several of transformers' 16-token chunks
    ),
}

_WORST: dict[str, float] = {}  # largest relative error seen per kind, printed with `pytest -s`


def make_config(**overrides) -> NemotronHConfig:
    return tiny_nemotron_h_config(**{**BASE, **overrides})


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Large enough weights that every path matters: matrices N(0, 0.2), vectors N(0, 0.1), norms around 1,
    moderate decays, dt_bias as transformers initializes it (so softplus(dt + dt_bias) falls under time_step_min
    for many tokens of the low heads), and a nonzero router correction bias."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith("A_log"):
            p.copy_(torch.rand(p.shape, generator=gen) * 2 - 2.5)  # A = exp(A_log) in [0.08, 0.6]
        elif name.endswith("dt_bias"):
            p.copy_(draw_dt_bias(model.config, p.numel(), gen))
        elif name.endswith("norm.weight") or name.endswith("norm_f.weight"):
            p.copy_(1 + 0.1 * noise)
        elif p.dim() == 1:
            p.copy_(0.1 * noise)
        else:
            p.copy_(0.2 * noise)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.05 * torch.randn(b.shape, generator=gen))
    return model


def build_pair(config, tmp_path, seed: int = 0):
    """A randomized transformers model, saved by transformers and loaded back as ours."""
    torch.manual_seed(seed)
    hf = randomize_(HFNemotronH(config).float(), seed).eval()
    hf.config._attn_implementation = "eager"
    follow_configured_time_step_limit_(hf)
    path = tmp_path / "hf"
    hf.save_pretrained(path)
    return hf, NemotronHForCausalLM.from_pretrained(path)


def follow_configured_time_step_limit_(hf: HFNemotronH) -> None:
    """transformers 5.17-5.24 clamp dt to (time_step_min, inf) whatever the config says; 5.25 (uv.lock) and
    mamba-ssm clamp to config.time_step_limit, which we follow. Give older versions the configured bounds."""
    if Version(transformers.__version__) < Version("5.25"):
        for module in hf.modules():
            if hasattr(module, "time_step_limit"):
                module.time_step_limit = tuple(hf.config.time_step_limit)


def record(kind: str, err: float) -> None:
    _WORST[kind] = max(_WORST.get(kind, 0.0), err)


def doc_slices(seq_lens):
    start = 0
    for n in seq_lens:
        yield slice(start, start + n)
        start += n


def random_row(config, seq_lens, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (sum(seq_lens),), generator=gen)


@pytest.fixture(scope="module", autouse=True)
def _report_worst_errors():
    """Prints the largest relative errors of this module's comparisons at the end (visible with ``pytest -s``)."""
    yield
    for kind, err in sorted(_WORST.items()):
        print(f"\n[nemotron-h-hf] worst relative error, {kind}: {err:.3e}")


# --------------------------------------------------------------------------------------------------------
# 1. Parity with transformers: logits and parameter gradients, packed row vs documents alone


@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_transformers(case, tmp_path):
    overrides, seq_lens = CASES[case]
    config = make_config(**overrides)
    hf, ours = build_pair(config, tmp_path, seed=len(case))
    assert [layer.block_type for layer in ours.model.layers] == config.layers_block_type
    assert ours.lm_head.weight is not ours.model.embeddings.weight
    ids = random_row(config, seq_lens, seed=1)
    weights = torch.randn(ids.numel(), config.vocab_size, generator=torch.Generator().manual_seed(2))

    out = ours(ids, seq_lens)
    assert out.token_log_probs is None and out.hidden_states.shape == (ids.numel(), config.hidden_size)
    (out.logits * weights).sum().backward()
    our_grads = {n: p.grad for n, p in ours.named_parameters()}

    for part in doc_slices(seq_lens):
        ref = hf(input_ids=ids[None, part], use_cache=False).logits[0]
        err = relative_max(out.logits[part].detach(), ref.detach())
        record("logits", err)
        assert err < TOL, f"logits of document {part}: relative error {err:.2e}"
        (ref * weights[part]).sum().backward()
    ref_grads = {n: p.grad for n, p in hf.named_parameters()}

    assert our_grads.keys() == ref_grads.keys()
    errors = {}
    for name, grad in our_grads.items():
        assert grad is not None and ref_grads[name] is not None, name
        errors[name] = relative_max(grad, ref_grads[name])
        record("grads", errors[name])
    bad = {n: e for n, e in errors.items() if e > GRAD_TOL}
    assert not bad, f"gradients differ: {bad}"


# name -> time_step_limit. time_step_min is 1e-3 (the default); dt_bias as transformers draws it puts the low heads'
# softplus(dt + dt_bias) under 1e-3 for many tokens and, with a positive lower limit, every third head under it.
CLAMP_CASES = {
    "released_limit_0_inf": (0.0, math.inf),
    "lower_and_upper_limit": (4e-3, 5e-2),
}


def _clamp_errors(ours, hf, ids, seq_lens, weights) -> dict[str, float]:
    """Relative errors of ours (packed row) vs transformers (document by document): logits, dt_bias, A_log grads."""
    for model in (ours, hf):
        model.zero_grad(set_to_none=True)
    out = ours(ids, seq_lens)
    (out.logits * weights).sum().backward()
    errors = {"logits": 0.0}
    for part in doc_slices(seq_lens):
        ref = hf(input_ids=ids[None, part], use_cache=False).logits[0]
        errors["logits"] = max(errors["logits"], relative_max(out.logits[part].detach(), ref.detach()))
        (ref * weights[part]).sum().backward()
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("dt_bias", "A_log"):
            errors[leaf] = max(errors.get(leaf, 0.0), relative_max(p.grad, hf_params[name].grad))
    return errors


@pytest.mark.parametrize("case", list(CLAMP_CASES))
def test_time_step_clamp_matches_transformers(case, tmp_path):
    """dt is clamped to config.time_step_limit as transformers does; clamping at time_step_min instead (what
    transformers 5.17-5.24 do) moves the dt_bias and A_log gradients far outside the tolerance."""
    config = make_config(
        hybrid_override_pattern="M*M",
        time_step_limit=CLAMP_CASES[case],
        mamba_num_heads=8,
        mamba_head_dim=4,
        n_groups=2,
    )
    hf, ours = build_pair(config, tmp_path, seed=11)
    low = float(config.time_step_limit[0])
    mixers = [m for m in ours.modules() if isinstance(m, NemotronHMamba2Mixer)]
    assert all(m.time_step_limit == CLAMP_CASES[case] for m in mixers)
    if low > 0:  # the heads put under the lower limit stay there
        assert all((F.softplus(m.dt_bias[::3]) < low).all() for m in mixers)
    seq_lens = [9, 2, 21]
    ids = random_row(config, seq_lens, seed=1)
    weights = torch.randn(ids.numel(), config.vocab_size, generator=torch.Generator().manual_seed(2))

    errors = _clamp_errors(ours, hf, ids, seq_lens, weights)
    for kind, err in errors.items():
        record(f"clamp {kind}", err)
    assert errors["logits"] < TOL and errors["dt_bias"] < GRAD_TOL and errors["A_log"] < GRAD_TOL, errors

    for mixer in mixers:
        mixer.time_step_limit = (config.time_step_min, math.inf)
    old = _clamp_errors(ours, hf, ids, seq_lens, weights)
    print(f"\n[nemotron-h-hf] {case}: configured clamp {errors}, clamp at time_step_min {old}")
    assert min(old.values()) > 1e-3, old  # >= 20x the tolerances above


def test_packed_documents_stay_apart(tmp_path):
    """The same document gives the same logits wherever it sits in a packed row (and alone)."""
    config = make_config(hybrid_override_pattern="M*M")
    _, ours = build_pair(config, tmp_path, seed=3)
    doc = random_row(config, [9], seed=4)
    other = random_row(config, [13], seed=5)
    with torch.no_grad():
        alone = ours(doc, [9]).logits
        packed = ours(torch.cat([other, doc]), [13, 9]).logits[13:]
        joined = ours(torch.cat([other, doc]), [22]).logits[13:]
    assert relative_max(packed, alone) < TOL
    assert relative_max(joined, alone) > 1e-2  # without the boundary the first document leaks into the second


# --------------------------------------------------------------------------------------------------------
# 2. Per-token log-probs without [T, vocab] logits


@pytest.mark.parametrize("chunk_size", [3, 64])
def test_model_token_log_probs_match_logits(chunk_size, tmp_path):
    config = make_config(hybrid_override_pattern="ME*")
    _, ours = build_pair(config, tmp_path, seed=11)
    seq_lens = [5, 2, 13]
    ids = random_row(config, seq_lens, seed=12)
    gen = torch.Generator().manual_seed(13)
    labels = torch.randint(0, config.vocab_size, ids.shape, generator=gen)
    labels[[0, 4, 6, 19]] = -100
    upstream = torch.randn(ids.shape, generator=gen)

    out = ours(ids, seq_lens, labels=labels, loss_chunk_size=chunk_size)
    assert out.logits is None
    (out.token_log_probs * upstream).sum().backward()
    got = {n: p.grad.clone() for n, p in ours.named_parameters()}
    ours.zero_grad()

    full = ours(ids, seq_lens, labels=labels, return_logits=True)
    ref = torch.log_softmax(full.logits, -1).gather(1, labels.clamp_min(0)[:, None]).squeeze(1) * (labels >= 0)
    err = relative_max(out.token_log_probs.detach(), ref.detach())
    record("token_log_probs", err)
    assert err < TOL
    assert (out.token_log_probs[labels < 0] == 0).all()
    (ref * upstream).sum().backward()
    for name, p in ours.named_parameters():
        assert relative_max(got[name], p.grad) < TOL, name


# --------------------------------------------------------------------------------------------------------
# 3. Checkpoints: both directions, original and in-memory layouts, sharded, missing and unknown tensors


def _our_model(config, seed) -> NemotronHForCausalLM:
    torch.manual_seed(seed)
    return randomize_(NemotronHForCausalLM(config), seed)


@pytest.mark.parametrize("pattern", ["M*M-", "ME*E"])
def test_our_checkpoint_loads_in_transformers(pattern, tmp_path):
    config = make_config(hybrid_override_pattern=pattern)
    ours = _our_model(config, seed=21)
    ours.save_pretrained(tmp_path)
    saved = read_safetensors(tmp_path)
    assert "lm_head.weight" in saved and "backbone.embeddings.weight" in saved
    assert not any(n.startswith("model.") for n in saved)
    if "E" in pattern:  # per-expert, as transformers writes
        assert "backbone.layers.1.mixer.experts.3.up_proj.weight" in saved
        assert "backbone.layers.1.mixer.gate.e_score_correction_bias" in saved

    hf, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True, attn_implementation="eager")
    assert type(hf) is HFNemotronH
    follow_configured_time_step_limit_(hf)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    hf_state, our_state = hf.state_dict(), ours.state_dict()
    assert hf_state.keys() == our_state.keys()
    for name, t in our_state.items():
        assert torch.equal(hf_state[name], t), name

    seq_lens = [6, 3]
    ids = random_row(config, seq_lens, seed=22)
    with torch.no_grad():
        got = ours(ids, seq_lens).logits
        for part in doc_slices(seq_lens):
            err = relative_max(got[part], hf(input_ids=ids[None, part], use_cache=False).logits[0])
            record("logits", err)
            assert err < TOL

    again = NemotronHForCausalLM.from_pretrained(tmp_path)
    for name, t in our_state.items():
        assert torch.equal(again.state_dict()[name], t), name

    # Weights given explicitly (as gathered from FSDP shards) are written instead of the module's own.
    doubled = {name: 2 * t for name, t in our_state.items()}
    again.save_pretrained(tmp_path / "given", state_dict=doubled)
    reloaded = NemotronHForCausalLM.from_pretrained(tmp_path / "given")
    for name, t in doubled.items():
        assert torch.equal(reloaded.state_dict()[name], t), name


def test_save_pretrained_leaves_the_model_config_unchanged(tmp_path):
    ours = _our_model(make_config(hybrid_override_pattern="M*-"), seed=24)
    before = ours.config.to_dict()
    ours.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())["architectures"]
    assert written == ["NemotronHForCausalLM"]
    assert before["architectures"] != written  # the file names the class; the model's own config stays as given
    assert ours.config.to_dict() == before


def test_in_memory_layout_sharded_and_mtp_checkpoints_load(tmp_path):
    """``model.``-prefixed stacked experts (transformers' in-memory names), sharded files, and MTP tensors
    (dropped, as transformers does) all load to the same model."""
    config = make_config(hybrid_override_pattern="ME*")
    ours = _our_model(config, seed=31)
    state = dict(ours.state_dict())
    assert "model.layers.1.mixer.experts.up_proj" in state
    state["mtp.layers.0.norm.weight"] = torch.ones(4)
    write_safetensors(state, tmp_path / "stacked", max_shard_bytes=8 * 1024)
    config.save_pretrained(tmp_path / "stacked")
    index = json.loads((tmp_path / "stacked" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    loaded = NemotronHForCausalLM.from_pretrained(tmp_path / "stacked")
    for name, t in ours.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    ids = random_row(config, [4, 3], seed=32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, [4, 3]).logits, ours(ids, [4, 3]).logits, rtol=0, atol=0)


@pytest.mark.parametrize(
    "drop",
    [
        "backbone.layers.0.mixer.A_log",
        "backbone.layers.0.mixer.conv1d.bias",
        "backbone.layers.1.mixer.experts.2.down_proj.weight",
        "backbone.layers.1.mixer.gate.e_score_correction_bias",
        "backbone.layers.2.mixer.k_proj.weight",
        "lm_head.weight",
    ],
)
def test_missing_tensor_raises(drop, tmp_path):
    config = make_config(hybrid_override_pattern="ME*")
    _our_model(config, seed=51).save_pretrained(tmp_path)
    state = read_safetensors(tmp_path)
    del state[drop]
    write_safetensors(state, tmp_path)
    name = drop.replace("backbone.", "model.")
    with pytest.raises(ContextParallelError, match=r"lacks .*" + name.replace(".", r"\.")):
        NemotronHForCausalLM.from_pretrained(tmp_path)


def test_unexpected_tensor_raises(tmp_path):
    config = make_config(hybrid_override_pattern="M-")
    _our_model(config, seed=52).save_pretrained(tmp_path)
    state = read_safetensors(tmp_path)
    state["backbone.layers.7.mixer.up_proj.weight"] = torch.zeros(2, 2)
    write_safetensors(state, tmp_path)
    with pytest.raises(ContextParallelError, match=r"model\.layers\.7\.mixer\.up_proj\.weight"):
        NemotronHForCausalLM.from_pretrained(tmp_path)


def test_from_pretrained_dtype_keeps_router_fp32(tmp_path):
    config = make_config(hybrid_override_pattern="ME")
    source = _our_model(config, seed=53)
    source.save_pretrained(tmp_path)
    model = NemotronHForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, mamba_cp_style="a2a")
    assert model.model.layers[0].mixer.in_proj.weight.dtype == torch.bfloat16
    assert model.model.layers[0].mixer.cp_style == "a2a"
    gate, source_gate = model.model.layers[1].mixer.gate, source.model.layers[1].mixer.gate
    assert gate.weight.dtype == torch.float32 and gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(gate.weight, source_gate.weight)  # never rounded through bf16
    assert torch.equal(gate.e_score_correction_bias, source_gate.e_score_correction_bias)
    if Version(transformers.__version__) >= Version("5.24"):  # transformers 5.17 and 5.20 cast the router too
        hf = HFNemotronH.from_pretrained(tmp_path, dtype=torch.bfloat16)
        assert hf.model.layers[1].mixer.gate.weight.dtype == torch.float32
        assert hf.model.layers[1].mixer.gate.e_score_correction_bias.dtype == torch.float32
    with torch.no_grad():
        assert model(random_row(config, [5], seed=1), [5]).logits.dtype == torch.bfloat16


def test_mixed_dtype_checkpoint_loads_in_the_config_dtype(tmp_path):
    """Without a dtype, every floating-point tensor but the router's takes transformers' "auto" dtype (the one the
    saved config names), so a checkpoint with a norm stored in fp32 among bf16 tensors runs."""
    config = make_config(hybrid_override_pattern="ME")
    _our_model(config, seed=55).to(torch.bfloat16).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    state = read_safetensors(tmp_path)
    state["backbone.layers.0.norm.weight"] = state["backbone.layers.0.norm.weight"].float()
    write_safetensors(state, tmp_path)
    model = NemotronHForCausalLM.from_pretrained(tmp_path)
    assert model.model.layers[0].norm.weight.dtype == torch.bfloat16
    assert model.model.layers[1].mixer.gate.weight.dtype == torch.float32
    with torch.no_grad():
        assert model(random_row(config, [5, 3], seed=2), [5, 3]).logits.dtype == torch.bfloat16


# --------------------------------------------------------------------------------------------------------
# 4. Pieces: router, experts, initialization


@pytest.mark.parametrize(
    ("experts", "top_k", "n_group", "topk_group", "norm", "scale"),
    [(4, 2, 1, 1, True, 1.0), (8, 2, 4, 2, True, 2.5), (8, 3, 2, 1, False, 1.0), (6, 1, 3, 2, True, 0.5)],
)
def test_router_matches_transformers(experts, top_k, n_group, topk_group, norm, scale):
    config = make_config(
        n_routed_experts=experts,
        num_experts_per_tok=top_k,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=norm,
        routed_scaling_factor=scale,
    )
    router = randomize_(NemotronHTopkRouter(config), experts + top_k)
    hf = HFRouter(config)
    hf.weight.data.copy_(router.weight.data)
    hf.e_score_correction_bias.copy_(router.e_score_correction_bias)
    x = torch.randn(33, config.hidden_size, generator=torch.Generator().manual_seed(top_k))
    weights, chosen = router(x)
    _, hf_weights, hf_chosen = hf(x)
    assert torch.equal(chosen, hf_chosen)
    torch.testing.assert_close(weights, hf_weights, rtol=0, atol=0)
    assert weights.dtype == torch.float32
    if n_group > 1:  # every token's experts lie in at most topk_group groups
        per_group = experts // n_group
        assert all(len(set((row // per_group).tolist())) <= topk_group for row in chosen)


def _naive_experts(experts: NemotronHExperts, x, chosen, weights):
    rows = []
    for n in range(x.size(0)):
        y = torch.zeros_like(x[n])
        for k in range(chosen.size(1)):
            e = int(chosen[n, k])
            y = y + weights[n, k] * (experts.down_proj[e] @ F.relu(experts.up_proj[e] @ x[n]).square())
        rows.append(y)
    return torch.stack(rows)


def test_experts_looped_matches_naive():
    config = make_config(n_routed_experts=6, num_experts_per_tok=2)
    torch.manual_seed(0)
    router, experts = randomize_(NemotronHTopkRouter(config), 1), randomize_(NemotronHExperts(config), 2)
    x = torch.randn(13, config.hidden_size, requires_grad=True)
    weights, _ = router(x)
    gen = torch.Generator().manual_seed(3)
    first = torch.randint(0, 5, (13,), generator=gen)
    chosen = torch.stack([first, (first + torch.randint(1, 5, (13,), generator=gen)) % 5], dim=1)  # 5 gets none
    looped = experts(x, chosen, weights)
    naive = _naive_experts(experts, x, chosen, weights)
    assert relative_max(looped.detach(), naive.detach()) < 1e-6
    params = [x, experts.up_proj, experts.down_proj, router.weight]
    upstream = torch.randn_like(looped)
    got = torch.autograd.grad((looped * upstream).sum(), params, retain_graph=True)
    ref = torch.autograd.grad((naive * upstream).sum(), params)
    for a, b in zip(got, ref, strict=True):
        assert relative_max(a, b) < 1e-6
    assert (got[1][5] == 0).all() and (got[2][5] == 0).all()


def test_activations_match_transformers():
    from transformers.activations import ACT2FN

    x = torch.randn(4096, dtype=torch.float64) * 4
    for name in (*ACTIVATIONS, "quick_gelu"):  # the last one comes from transformers itself
        torch.testing.assert_close(activation(name)(x), ACT2FN[name](x), rtol=0, atol=0)


def test_init_weights_like_transformers():
    config = make_config(hybrid_override_pattern="M*ME-", mamba_num_heads=16, mamba_head_dim=16, hidden_size=64)
    torch.manual_seed(0)
    ours = NemotronHForCausalLM(config)
    torch.manual_seed(0)
    hf = HFNemotronH(config)
    mixer = ours.model.layers[0].mixer
    assert isinstance(mixer, NemotronHMamba2Mixer)
    torch.testing.assert_close(mixer.A_log, torch.log(torch.arange(1.0, 17.0)))
    assert (mixer.D == 1).all()
    dt = F.softplus(mixer.dt_bias)
    assert (dt >= config.time_step_min * 0.999).all() and (dt <= config.time_step_max * 1.001).all()
    bound = 1 / math.sqrt(mixer.intermediate_size) / math.sqrt(5)  # Kaiming-uniform(a=sqrt 5) / sqrt(layers)
    assert mixer.out_proj.weight.abs().max() <= bound
    hf_state = hf.state_dict()
    for name, p in ours.state_dict().items():  # same distribution per tensor as transformers' init
        if name.endswith(("norm.weight", "norm_f.weight", ".D", "e_score_correction_bias", "conv1d.bias")):
            assert torch.equal(p, hf_state[name]), name
        elif p.numel() >= 256:
            assert abs(p.std().item() - hf_state[name].std().item()) < 0.25 * hf_state[name].std().item(), name


# --------------------------------------------------------------------------------------------------------
# 5. Activation checkpointing


def test_activation_checkpointing_same_logits_and_grads(tmp_path):
    config = make_config(hybrid_override_pattern="ME*M")
    _, plain = build_pair(config, tmp_path, seed=61)
    wrapped = NemotronHForCausalLM.from_pretrained(tmp_path / "hf")
    keys_before = list(wrapped.state_dict())
    assert apply_activation_checkpointing(wrapped) is wrapped
    assert all(type(layer).__name__ == "CheckpointWrapper" for layer in wrapped.model.layers)
    wrapped.save_pretrained(tmp_path / "wrapped")  # wrapper prefixes never reach the checkpoint
    assert read_safetensors(tmp_path / "wrapped").keys() == read_safetensors(tmp_path / "hf").keys()
    assert [k.replace("._checkpoint_wrapped_module", "") for k in wrapped.state_dict()] == keys_before

    seq_lens = [6, 1, 9]
    ids = random_row(config, seq_lens, seed=62)
    gen = torch.Generator().manual_seed(63)
    labels = torch.randint(0, config.vocab_size, ids.shape, generator=gen)
    weights = torch.randn(ids.numel(), config.vocab_size, generator=gen)
    grads, logits = [], []
    for model in (plain, wrapped):
        out = model(ids, seq_lens, labels=labels, return_logits=True)
        ((out.logits * weights).sum() + out.token_log_probs.sum()).backward()
        logits.append(out.logits.detach())
        grads.append({n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in model.named_parameters()})
    assert torch.equal(logits[1], logits[0])
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        assert relative_max(grads[1][name], g) <= 1e-6, name


# --------------------------------------------------------------------------------------------------------
# 6. Bad input


@pytest.fixture(scope="module")
def small_model():
    torch.manual_seed(0)
    return NemotronHForCausalLM(make_config(hybrid_override_pattern="M*"))


def test_bad_forward_arguments_raise(small_model):
    ids = torch.randint(0, 80, (8,))
    with pytest.raises(ContextParallelError, match="batch size 2"):
        small_model(torch.randint(0, 80, (2, 8)), [8])
    with pytest.raises(ContextParallelError):
        small_model(ids, [3, 4])
    with pytest.raises(ContextParallelError, match="exactly one"):
        small_model(None, [8])
    with pytest.raises(ContextParallelError, match="position_ids"):
        small_model(ids, [8], position_ids=torch.arange(7))
    with pytest.raises(ContextParallelError, match="labels"):
        small_model(ids, [8], labels=torch.zeros(7, dtype=torch.long))
    # the shared row checks (cp_models.row_inputs.check_row_inputs, tested in full with Qwen3.5) run here too
    with pytest.raises(ContextParallelError, match="inputs_embeds has batch size 2"):
        small_model(None, [8], inputs_embeds=small_model.model.embeddings(ids).detach().expand(2, -1, -1))
    with pytest.raises(ContextParallelError, match="seq_lens sum to 9 tokens but this rank holds 8"):
        small_model(ids, [4, 5])
    with torch.no_grad():  # [1, T], embeddings and (unused) positions give the same logits
        ref = small_model(ids, [3, 5]).logits
        torch.testing.assert_close(small_model(ids[None], [3, 5]).logits, ref, rtol=0, atol=0)
        embeds = small_model.model.embeddings(ids)
        torch.testing.assert_close(small_model(None, [3, 5], inputs_embeds=embeds[None]).logits, ref, rtol=0, atol=0)
        positions = torch.cat([torch.arange(3), torch.arange(5)])
        torch.testing.assert_close(small_model(ids, [3, 5], position_ids=positions).logits, ref, rtol=0, atol=0)


def test_bad_configs_raise(tmp_path):
    with pytest.raises(ContextParallelError, match="mamba_cp_style"):
        NemotronHForCausalLM(make_config(hybrid_override_pattern="M"), mamba_cp_style="ring")
    with pytest.raises(ContextParallelError, match="time_step_limit"):
        NemotronHForCausalLM(make_config(hybrid_override_pattern="M", time_step_limit=(0.1, 0.01)))
    with pytest.raises(ContextParallelError, match="n_groups=3"):
        NemotronHForCausalLM(make_config(hybrid_override_pattern="M", n_groups=3))
    llama = LlamaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ContextParallelError, match="llama"):
        load_nemotron_h_config(llama)
    llama.save_pretrained(tmp_path)
    with pytest.raises(ContextParallelError, match="not a Nemotron-H config"):
        NemotronHForCausalLM.from_pretrained(tmp_path)
    config = make_config(hybrid_override_pattern="M")
    assert load_nemotron_h_config(config) is config
