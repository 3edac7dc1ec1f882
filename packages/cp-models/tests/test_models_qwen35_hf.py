"""Qwen3.5 (dense and MoE) on CPU in fp32 against transformers' reference models.

transformers' torch fallbacks for Gated DeltaNet do not keep packed documents apart, so every comparison runs
our model on a packed row and transformers' model on each document alone ([1, L_i], default positions).
Parameters are randomized on the transformers side, saved with ``save_pretrained`` and loaded with our
``from_pretrained``, so the real checkpoint path is exercised by every parity test.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
)
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTopKRouter

from cp_core import ContextParallelError
from cp_core.testing import relative_max
from cp_models import Qwen35ForCausalLM, apply_activation_checkpointing, load_text_config, token_log_probs
from cp_models.hf_checkpoint import read_safetensors, write_safetensors
from cp_models.presets import tiny_qwen35_config, tiny_qwen35_moe_config
from cp_models.qwen3_5 import Qwen35Experts, Qwen35Router

TOL = 1e-5  # relative: max |ours - ref| / max |ref|, for logits and log-probs
# Parameter gradients are compared at 1e-4: in these random fp32 models they carry 1e-6..6e-5 relative rounding
# noise (largest for the GDN decay parameters A_log / dt_bias and for the 4-layer model), and transformers' own fp32
# gradients differ from its fp64 gradients by as much (checked while writing these tests; a model-level bug shows
# up at 1e-3 or more).
GRAD_TOL = 1e-4
LIN, FULL = "linear_attention", "full_attention"

BASE = dict(  # overrides of the tiny Qwen3.5 preset (cp_models.presets.TINY_QWEN35)
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    tie_word_embeddings=False,
)
BASE_ROPE = {
    "rope_type": "default",
    "rope_theta": 10_000_000.0,
    "partial_rotary_factor": 0.25,
    "mrope_section": [1, 1, 0],
}

# name -> (moe?, config overrides, packed document lengths). Every row holds a document of 1-3 tokens.
CASES = {
    "dense_every4th_full": (False, dict(num_hidden_layers=4, layer_types=None), [7, 2, 11]),
    "dense_full_lin_lin_gqa4to1_tied": (
        False,
        dict(layer_types=[FULL, LIN, LIN], num_key_value_heads=1, tie_word_embeddings=True),
        [1, 9, 5, 4],
    ),
    "dense_all_linear_equal_gdn_heads": (
        False,
        dict(layer_types=[LIN, LIN], linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16),
        [3, 70, 6],  # 70 > the 64-token chunk of both implementations
    ),
    "dense_all_full_mha_bias_tied": (
        False,
        dict(
            layer_types=[FULL, FULL],
            num_key_value_heads=4,
            tie_word_embeddings=True,
            hidden_size=64,
            attention_bias=True,
        ),
        [12, 2],
    ),
    "moe4_lin_full": (True, dict(layer_types=[LIN, FULL]), [6, 1, 10]),
    # hidden_act reaches the MLP (no GDN layer: its conv takes silu only)
    "dense_all_full_gelu_tanh": (False, dict(layer_types=[FULL, FULL], hidden_act="gelu_pytorch_tanh"), [9, 2, 6]),
    "moe4_all_full_gelu": (True, dict(layer_types=[FULL, FULL], hidden_act="gelu"), [3, 11]),
    "moe8_full_lin_lin_tied": (
        True,
        dict(layer_types=[FULL, LIN, LIN], num_experts=8, num_key_value_heads=1, tie_word_embeddings=True),
        [2, 8, 3, 5],
    ),
}

_WORST: dict[str, float] = {}  # largest relative error seen per kind, printed with `pytest -s`


def make_config(moe: bool, **overrides):
    kw = {**BASE, **overrides}  # the MoE preset: 4 experts, top-2, expert 16 and shared expert 24 wide
    if kw.get("layer_types") is None:
        kw["layer_types"] = None  # transformers' pattern for num_hidden_layers (every 4th full attention)
    else:
        kw["num_hidden_layers"] = len(kw["layer_types"])
    return (tiny_qwen35_moe_config if moe else tiny_qwen35_config)(**kw)


def hf_class(config):
    return Qwen3_5MoeForCausalLM if getattr(config, "num_experts", 0) else Qwen3_5ForCausalLM


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Large enough weights that every path matters: matrices N(0, 0.2), vectors N(0, 0.1), moderate decay."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith("A_log"):
            p.copy_(torch.rand(p.shape, generator=gen) * 2 - 2.5)  # A = exp(A_log) in [0.08, 0.6]
        elif name.endswith("linear_attn.norm.weight"):  # one-centered gated norm
            p.copy_(1 + 0.1 * noise)
        elif p.dim() == 1:
            p.copy_(0.1 * noise)
        else:
            p.copy_(0.2 * noise)
    return model


def build_pair(config, tmp_path, seed: int = 0):
    """A randomized transformers model, saved by transformers and loaded back as ours."""
    torch.manual_seed(seed)
    hf = randomize_(hf_class(config)(config).float(), seed).eval()
    hf.config._attn_implementation = "eager"
    path = tmp_path / "hf"
    hf.save_pretrained(path)
    ours = Qwen35ForCausalLM.from_pretrained(path)
    return hf, ours


def record(kind: str, err: float) -> None:
    _WORST[kind] = max(_WORST.get(kind, 0.0), err)


def doc_slices(seq_lens):
    start = 0
    for n in seq_lens:
        yield slice(start, start + n)
        start += n


def random_row(config, seq_lens, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (sum(seq_lens),), generator=gen)


def assert_grads_close(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tol: float, kind: str):
    assert ours.keys() == ref.keys()
    worst = {}
    for name, grad in ours.items():
        assert grad is not None, name
        worst[name] = relative_max(grad, ref[name])
        record(f"{kind} (A_log, dt_bias)" if name.endswith(("A_log", "dt_bias")) else kind, worst[name])
    bad = {n: e for n, e in worst.items() if e > tol}
    assert not bad, f"gradients differ: {bad}"


@pytest.fixture(scope="module", autouse=True)
def _report_worst_errors():
    """Prints the largest relative errors of this module's comparisons at the end (visible with ``pytest -s``)."""
    yield
    for kind, err in sorted(_WORST.items()):
        print(f"\n[qwen35-hf] worst relative error, {kind}: {err:.3e}")


# --------------------------------------------------------------------------------------------------------
# 1. Parity with transformers: logits and parameter gradients, packed row vs documents alone


@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_transformers(case, tmp_path):
    moe, overrides, seq_lens = CASES[case]
    config = make_config(moe, **overrides)
    if overrides.get("layer_types", ()) is None:
        assert config.layer_types == [LIN, LIN, LIN, FULL]  # transformers' default: every 4th layer full
    hf, ours = build_pair(config, tmp_path, seed=len(case))
    assert [layer.layer_type for layer in ours.model.layers] == config.layer_types
    if moe:
        assert isinstance(ours.model.layers[0].mlp.experts, Qwen35Experts)
    if config.tie_word_embeddings:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert_parity(hf, ours, config, random_row(config, seq_lens, seed=1), seq_lens)


def assert_parity(hf, ours, config, ids: torch.Tensor, seq_lens) -> None:
    """Logits per document and every parameter gradient: ours on the packed row, transformers on each document."""
    weights = torch.randn(ids.numel(), config.vocab_size, generator=torch.Generator().manual_seed(2))

    # ours: one packed row
    out = ours(ids, seq_lens)
    assert out.token_log_probs is None and out.hidden_states.shape == (ids.numel(), config.hidden_size)
    (out.logits * weights).sum().backward()
    our_grads = {n: p.grad for n, p in ours.named_parameters()}

    # transformers: one document at a time, gradients accumulated
    for part in doc_slices(seq_lens):
        ref_logits = hf(input_ids=ids[None, part], use_cache=False).logits[0]
        err = relative_max(out.logits[part].detach(), ref_logits.detach())
        record("logits", err)
        assert err < TOL, f"logits of document {part}: relative error {err:.2e}"
        (ref_logits * weights[part]).sum().backward()
    ref_grads = {n: p.grad for n, p in hf.named_parameters()}
    assert_grads_close(our_grads, ref_grads, GRAD_TOL, "grads")


def test_pad_token_row_gets_no_gradient_as_in_transformers(tmp_path):
    """transformers builds the embedding with ``padding_idx=pad_token_id``: that row gets no gradient, even where
    the token occurs inside a document, and initializes to zero."""
    config = make_config(False, layer_types=[LIN, FULL], pad_token_id=5)
    hf, ours = build_pair(config, tmp_path, seed=17)
    seq_lens = [8, 3, 9]
    ids = random_row(config, seq_lens, seed=6)
    ids[[0, 4, 9, 15]] = 5
    assert_parity(hf, ours, config, ids, seq_lens)
    assert ours.model.embed_tokens.weight.grad[5].abs().max() == 0
    assert ours.model.embed_tokens.weight.grad[ids[1]].abs().max() > 0
    fresh = Qwen35ForCausalLM(config)
    assert fresh.model.embed_tokens.weight[5].abs().max() == 0 < fresh.model.embed_tokens.weight[6].abs().max()


def test_gdn_refuses_an_activation_other_than_silu():
    config = make_config(False, layer_types=[FULL, LIN], hidden_act="gelu")
    with pytest.raises(ContextParallelError, match=r"hidden_act='gelu': .*silu only.*without linear_attention"):
        Qwen35ForCausalLM(config)


RESCALING_ROPES = {  # rope types transformers recomputes per call past a length: (rope_parameters, that length)
    "dynamic": ({"rope_type": "dynamic", "factor": 4.0}, 12),
    "longrope": (
        {
            "rope_type": "longrope",
            "short_factor": [1.0, 1.5],
            "long_factor": [3.0, 7.0],
            "original_max_position_embeddings": 10,
        },
        10,
    ),
}


@pytest.mark.parametrize("rope_type", list(RESCALING_ROPES))
def test_rescaling_ropes_match_transformers_up_to_their_length_and_refuse_past_it(rope_type, tmp_path):
    """Documents up to the length where transformers starts rescaling match it; a longer one raises, naming the
    length and the fix (transformers picks the frequencies per call from its longest position, not per document)."""
    extra, limit = RESCALING_ROPES[rope_type]
    rope = {**BASE_ROPE, "rope_theta": 100.0, **extra}  # fast rotations: positions change the logits visibly
    config = make_config(False, layer_types=[FULL, LIN], rope_parameters=rope, max_position_embeddings=12)
    hf, ours = build_pair(config, tmp_path, seed=19)
    seq_lens = [limit, 3, limit - 1]
    assert_parity(hf, ours, config, random_row(config, seq_lens, seed=7), seq_lens)
    long = [2, limit + 1]
    with pytest.raises(ContextParallelError, match=rf"document of {limit + 1} tokens .* rope_type='{rope_type}'"):
        ours(random_row(config, long, seed=8), long)
    with torch.no_grad():  # what the refusal protects: transformers' frequencies past the length differ
        ids = random_row(config, [3 * limit], seed=9)
        ref = hf(input_ids=ids[None], use_cache=False).logits[0]
        ours.model.rotary_emb.rescaled_past = None
        assert relative_max(ours(ids, [3 * limit]).logits, ref) > 1000 * TOL


def test_mrope_positions_match_transformers(tmp_path):
    """3-D MRoPE positions with full rotary and a real interleaved section split ([3, T] for ours)."""
    rope = {"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 1.0, "mrope_section": [2, 3, 3]}
    config = make_config(False, layer_types=[FULL, LIN], rope_parameters=rope)
    hf, ours = build_pair(config, tmp_path, seed=5)
    seq_lens = [6, 2, 9]
    ids = random_row(config, seq_lens, seed=3)
    gen = torch.Generator().manual_seed(4)
    positions = [torch.randint(0, 20, (3, n), generator=gen) for n in seq_lens]
    logits = ours(ids, seq_lens, position_ids=torch.cat(positions, dim=1)).logits
    for part, pos in zip(doc_slices(seq_lens), positions, strict=True):
        ref = hf(input_ids=ids[None, part], position_ids=pos[:, None], use_cache=False).logits[0]
        err = relative_max(logits[part].detach(), ref.detach())
        record("logits", err)
        assert err < TOL
    # explicit per-document text positions are what the default gives
    text_pos = torch.cat([torch.arange(n) for n in seq_lens])
    torch.testing.assert_close(ours(ids, seq_lens, position_ids=text_pos).logits, ours(ids, seq_lens).logits)


# --------------------------------------------------------------------------------------------------------
# 2. Per-token log-probs without [T, vocab] logits


def _reference_log_probs(hidden, weight, labels):
    logp = torch.log_softmax((hidden @ weight.t()).float(), dim=-1)
    return logp.gather(1, labels.clamp_min(0)[:, None]).squeeze(1) * (labels >= 0)


@pytest.mark.parametrize(
    ("t", "v", "chunk_size", "vocab_chunk_size"),
    [
        (16, 40, 1, None),  # fewer tokens than vocabulary: the outer loop runs over vocabulary tiles
        (16, 40, 3, 7),
        (16, 40, 5, 40),
        (16, 40, 16, 1),
        (16, 40, 17, 4096),
        (16, 40, None, None),
        (50, 12, 7, 5),  # more tokens than vocabulary: the outer loop runs over token chunks
        (50, 12, 50, 12),
        (50, 12, 1, 3),
    ],
)
def test_token_log_probs_function(t, v, chunk_size, vocab_chunk_size):
    gen = torch.Generator().manual_seed(t * v + (chunk_size or 0))
    h = 12
    hidden = torch.randn(t, h, generator=gen, requires_grad=True)
    weight = torch.randn(v, h, generator=gen, requires_grad=True)
    labels = torch.randint(0, v, (t,), generator=gen)
    labels[[0, 5, 6, 15]] = -100
    labels[1], labels[2] = 0, v - 1  # the first and last vocabulary entries (tile edges)
    upstream = torch.randn(t, generator=gen)

    got = token_log_probs(hidden, weight, labels, chunk_size, vocab_chunk_size)
    assert got.dtype == torch.float32 and (got[labels < 0] == 0).all()
    g_hidden, g_weight = torch.autograd.grad((got * upstream).sum(), [hidden, weight])
    ref = _reference_log_probs(hidden, weight, labels)
    r_hidden, r_weight = torch.autograd.grad((ref * upstream).sum(), [hidden, weight])
    for name, a, b in (("fwd", got, ref), ("hidden", g_hidden, r_hidden), ("weight", g_weight, r_weight)):
        err = relative_max(a.detach(), b.detach())
        record("token_log_probs", err)
        assert err < TOL, name


@pytest.mark.parametrize(("t", "v", "chunk_size", "vocab_chunk_size"), [(16, 40, 3, 7), (50, 12, 7, 5)])
def test_token_log_probs_fp64_is_fp64_forward_and_backward(t, v, chunk_size, vocab_chunk_size):
    """fp64 inputs (the fp64 test mode) stay fp64 through the tiles, the log-sum-exp and backward's accumulators:
    output and gradients equal autograd of a plain fp64 log-softmax to ~1e-15 (fp32 anywhere would give ~1e-7)."""
    gen = torch.Generator().manual_seed(t + v)
    hidden = torch.randn(t, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, v, (t,), generator=gen)
    labels[[0, 5]] = -100
    upstream = torch.randn(t, generator=gen, dtype=torch.float64)

    got = token_log_probs(hidden, weight, labels, chunk_size, vocab_chunk_size)
    assert got.dtype == torch.float64
    g_hidden, g_weight = torch.autograd.grad((got * upstream).sum(), [hidden, weight])
    logp = torch.log_softmax(hidden @ weight.t(), dim=-1)
    ref = logp.gather(1, labels.clamp_min(0)[:, None]).squeeze(1) * (labels >= 0)
    r_hidden, r_weight = torch.autograd.grad((ref * upstream).sum(), [hidden, weight])
    for name, a, b in (("fwd", got, ref), ("hidden", g_hidden, r_hidden), ("weight", g_weight, r_weight)):
        err = relative_max(a.detach(), b.detach())
        record("token_log_probs fp64", err)
        assert err < 1e-12, (name, err)


@pytest.mark.parametrize(("t", "v"), [(16, 40), (50, 12)])
def test_token_log_probs_with_one_input_frozen(t, v):
    """A frozen LM head (LoRA) or frozen states: the other gradient equals the one computed with both trainable."""
    gen = torch.Generator().manual_seed(t)
    hidden = torch.randn(t, 8, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, 8, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, v, (t,), generator=gen)
    labels[3] = -100
    upstream = torch.randn(t, generator=gen, dtype=torch.float64)

    def grads(hidden_grad: bool, weight_grad: bool):
        h, w = hidden.clone().requires_grad_(hidden_grad), weight.clone().requires_grad_(weight_grad)
        (token_log_probs(h, w, labels, 3, 7) * upstream).sum().backward()
        return h.grad, w.grad

    both = grads(True, True)
    frozen_weight, frozen_hidden = grads(True, False), grads(False, True)
    assert frozen_weight[1] is None and frozen_hidden[0] is None
    torch.testing.assert_close(frozen_weight[0], both[0], rtol=0, atol=0)
    torch.testing.assert_close(frozen_hidden[1], both[1], rtol=0, atol=0)


def test_token_log_probs_bf16_is_as_accurate_as_plain_cross_entropy():
    """bf16 inputs (the GPU training dtype): the chunked loss and its gradients are no further from the fp64 truth
    than transformers' way (bf16 logits, fp32 log-softmax, autograd), within 1.5x of its error."""
    gen = torch.Generator().manual_seed(0)
    t, h, v = 64, 32, 500
    hidden64 = torch.randn(t, h, generator=gen, dtype=torch.float64)
    weight64 = torch.randn(v, h, generator=gen, dtype=torch.float64) / 4
    labels = torch.randint(0, v, (t,), generator=gen)
    labels[::7] = -100
    upstream = torch.rand(t, generator=gen, dtype=torch.float64)

    def grads(fn, dtype):
        hidden = hidden64.to(dtype).requires_grad_()
        weight = weight64.to(dtype).requires_grad_()
        out = fn(hidden, weight)
        return [
            out.double(),
            *(g.double() for g in torch.autograd.grad((out * upstream.to(out.dtype)).sum(), [hidden, weight])),
        ]

    truth = grads(lambda hid, w: _reference_log_probs(hid, w, labels), torch.float64)
    ours = grads(lambda hid, w: token_log_probs(hid, w, labels, 24), torch.bfloat16)
    plain = grads(lambda hid, w: _reference_log_probs(hid, w, labels), torch.bfloat16)
    for name, t_, o, p in zip(("fwd", "hidden", "weight"), truth, ours, plain, strict=True):
        ours_err, plain_err = relative_max(o, t_), relative_max(p, t_)
        assert ours_err <= 1.5 * plain_err + 1e-6, (name, ours_err, plain_err)


def test_token_log_probs_function_rejects_bad_input():
    with pytest.raises(ContextParallelError, match="labels"):
        token_log_probs(torch.randn(4, 3), torch.randn(5, 3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ContextParallelError):
        token_log_probs(torch.randn(1, 4, 3), torch.randn(5, 3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ContextParallelError, match="width 3 != the LM head's 2"):
        token_log_probs(torch.randn(4, 3), torch.randn(5, 2), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ContextParallelError, match="label 5 is outside the vocabulary of 5"):
        token_log_probs(torch.randn(4, 3), torch.randn(5, 3), torch.tensor([0, 5, -100, 1]))
    with pytest.raises(ContextParallelError, match="vocab_chunk_size must be a positive"):
        token_log_probs(torch.randn(4, 3), torch.randn(5, 3), torch.zeros(4, dtype=torch.long), 2, 0)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("chunk_size", [3, 7, 64])
def test_model_token_log_probs_match_logits(moe, chunk_size, tmp_path):
    config = make_config(moe, layer_types=[LIN, FULL], tie_word_embeddings=moe)
    _, ours = build_pair(config, tmp_path, seed=11)
    seq_lens = [5, 2, 13]  # T = 20: chunks of 3 and 7 do not divide it
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
    assert full.logits is not None
    ref = torch.log_softmax(full.logits, -1).gather(1, labels.clamp_min(0)[:, None]).squeeze(1) * (labels >= 0)
    err = relative_max(out.token_log_probs.detach(), ref.detach())
    record("token_log_probs", err)
    assert err < TOL
    assert (out.token_log_probs[labels < 0] == 0).all()
    (ref * upstream).sum().backward()
    assert_grads_close(got, {n: p.grad for n, p in ours.named_parameters()}, TOL, "token_log_probs")
    # labels given as [1, T] are accepted too
    batched = ours(ids[None], seq_lens, labels=labels[None], loss_chunk_size=chunk_size).token_log_probs
    torch.testing.assert_close(batched, out.token_log_probs, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------------------
# 3. Checkpoints: ours -> transformers, sharded, VL-prefixed, missing tensors


def _our_model(config, seed):
    torch.manual_seed(seed)
    return randomize_(Qwen35ForCausalLM(config), seed)


@pytest.mark.parametrize(
    ("moe", "tied"),
    [(False, False), (False, True), (True, False), (True, True)],
    ids=["dense", "dense_tied", "moe", "moe_tied"],
)
def test_our_checkpoint_loads_in_transformers(moe, tied, tmp_path):
    config = make_config(moe, layer_types=[LIN, FULL, LIN], tie_word_embeddings=tied)
    ours = _our_model(config, seed=21)
    ours.save_pretrained(tmp_path)
    saved = read_safetensors(tmp_path)
    assert ("lm_head.weight" in saved) == (not tied)
    if moe:
        assert "model.layers.0.mlp.experts.3.gate_proj.weight" in saved  # per-expert, as transformers writes

    hf, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True, attn_implementation="eager")
    assert type(hf) is hf_class(config)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    hf_params = dict(hf.named_parameters())
    our_params = dict(ours.named_parameters())
    assert hf_params.keys() == our_params.keys()
    for name, p in our_params.items():
        assert torch.equal(hf_params[name], p), name
    if tied:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()

    ids = random_row(config, [9], seed=22)
    with torch.no_grad():
        ref = hf(input_ids=ids[None], use_cache=False).logits[0]
        got = ours(ids, [9]).logits
    err = relative_max(got, ref)
    record("logits", err)
    assert err < TOL

    # and back: the same checkpoint loads into ours unchanged
    again = Qwen35ForCausalLM.from_pretrained(tmp_path)
    assert again.state_dict().keys() == ours.state_dict().keys()
    assert (again.lm_head.weight is again.model.embed_tokens.weight) == tied  # tied again after loading
    for name, t in ours.state_dict().items():
        assert torch.equal(again.state_dict()[name], t), name


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_save_pretrained_leaves_the_model_config_unchanged(moe, tmp_path):
    ours = _our_model(make_config(moe, layer_types=[LIN, FULL]), seed=23)
    before = ours.config.to_dict()
    ours.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())["architectures"]
    assert written == ["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"]
    assert before["architectures"] != written  # the file names the class; the model's own config stays as given
    assert ours.config.to_dict() == before


def test_a_save_over_an_earlier_save_leaves_only_its_own_weight_files(tmp_path):
    """A single-file save over a sharded one (and the reverse) removes the other layout's files, and a folder that
    holds both (transformers leaves an old index behind) is read as transformers reads it: model.safetensors."""
    config = make_config(True, layer_types=[LIN, FULL])
    first, second = _our_model(config, seed=33), _our_model(config, seed=34)
    folder = tmp_path / "ckpt"
    write_safetensors(first.state_dict(), folder, max_shard_bytes=8 * 1024)
    (folder / "notes.txt").write_text("kept")
    second.save_pretrained(folder)
    assert sorted(f.name for f in folder.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]
    loaded = Qwen35ForCausalLM.from_pretrained(folder)
    for name, t in second.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name

    write_safetensors(read_safetensors(folder), folder, max_shard_bytes=8 * 1024)
    assert not (folder / "model.safetensors").exists() and (folder / "model.safetensors.index.json").exists()

    both = tmp_path / "both"  # complete shards of one model beside the single file of another
    write_safetensors(first.state_dict(), both, max_shard_bytes=8 * 1024)
    shutil.copy(folder / "config.json", both / "config.json")
    write_safetensors(second.state_dict(), tmp_path / "single")
    shutil.copy(tmp_path / "single" / "model.safetensors", both / "model.safetensors")
    loaded = Qwen35ForCausalLM.from_pretrained(both)
    for name, t in second.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name

    linked = tmp_path / "linked"  # a folder whose weights link into a hub cache: the cache blob stays as it is
    linked.mkdir()
    blob = tmp_path / "blob"
    blob.write_bytes((tmp_path / "single" / "model.safetensors").read_bytes())
    (linked / "model.safetensors").symlink_to(blob)
    first.save_pretrained(linked)
    assert blob.read_bytes() == (tmp_path / "single" / "model.safetensors").read_bytes()
    assert not (linked / "model.safetensors").is_symlink()
    assert torch.equal(read_safetensors(linked)["model.norm.weight"], first.state_dict()["model.norm.weight"])


def test_sharded_checkpoint_loads(tmp_path):
    config = make_config(True, layer_types=[LIN, FULL])
    ours = _our_model(config, seed=31)
    ours.save_pretrained(tmp_path / "single")
    state = read_safetensors(tmp_path / "single")
    write_safetensors(state, tmp_path / "sharded", max_shard_bytes=8 * 1024)
    shutil.copy(tmp_path / "single" / "config.json", tmp_path / "sharded" / "config.json")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2 and not (tmp_path / "sharded" / "model.safetensors").exists()
    assert index["weight_map"].keys() == state.keys()

    loaded = Qwen35ForCausalLM.from_pretrained(tmp_path / "sharded")
    for name, t in ours.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    ids = random_row(config, [4, 3], seed=32)
    with torch.no_grad():
        # The weights are bit-equal (above); the logits only to rounding: tensors read from the mmap'd shards sit
        # at other addresses, and CPU kernels may take other vector paths (seen once: 8e-7 absolute under load).
        torch.testing.assert_close(loaded(ids, [4, 3]).logits, ours(ids, [4, 3]).logits, rtol=1e-5, atol=1e-6)
    # transformers reads the sharded folder too
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "sharded", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_weight_files_that_do_not_load_say_why(tmp_path):
    """Pickle weights are never read; an index naming a missing shard, or a file outside the folder, is refused."""
    config = make_config(False, layer_types=[LIN, FULL])
    _our_model(config, seed=33).save_pretrained(tmp_path / "pickled")
    (tmp_path / "pickled" / "model.safetensors").rename(tmp_path / "pickled" / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"holds pytorch_model\.bin: pickle weights, never loaded"):
        Qwen35ForCausalLM.from_pretrained(tmp_path / "pickled")
    index = tmp_path / "pickled" / "model.safetensors.index.json"
    for weight_map, error, message in (
        ({"w": "model-00001-of-00002.safetensors"}, FileNotFoundError, "names model-00001-of-00002.safetensors, which"),
        ({"w": "../model.safetensors"}, ValueError, "names '../model.safetensors', not a file in"),
        ([], ValueError, "not a safetensors index"),
    ):
        index.write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(error, match=re.escape(message)):
            read_safetensors(tmp_path / "pickled")
    (tmp_path / "pickled" / "model-00001-of-00001.safetensors").write_bytes(b"\x02\x00")  # a header cut short
    index.write_text(json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}}))
    with pytest.raises(ValueError, match=r"model-00001-of-00001\.safetensors: SafetensorError: "):
        read_safetensors(tmp_path / "pickled")


@pytest.mark.parametrize("vl_config", [False, True], ids=["text_config", "vl_config"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_vl_prefixed_checkpoint_loads(moe, vl_config, tmp_path):
    config = make_config(moe, layer_types=[FULL, LIN])
    ours = _our_model(config, seed=41)
    ours.save_pretrained(tmp_path / "text")
    state = {}
    for name, t in read_safetensors(tmp_path / "text").items():
        state[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name] = t
    state["model.visual.patch_embed.proj.weight"] = torch.randn(4, 3)  # vision and MTP weights are dropped
    state["mtp.fc.weight"] = torch.randn(4, 4)
    assert not any(n.startswith("model.layers.") for n in state)
    write_safetensors(state, tmp_path / "vl")
    if vl_config:
        vl_class = Qwen3_5MoeConfig if moe else Qwen3_5Config
        vl_class(text_config=config.to_dict()).save_pretrained(tmp_path / "vl")
    else:
        config.save_pretrained(tmp_path / "vl")

    loaded = Qwen35ForCausalLM.from_pretrained(tmp_path / "vl")
    assert loaded.config.model_type == config.model_type
    for name, t in ours.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    ids = random_row(config, [5, 2], seed=42)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, [5, 2]).logits, ours(ids, [5, 2]).logits, rtol=0, atol=0)


@pytest.mark.parametrize(
    "drop",
    [
        "model.layers.1.linear_attn.A_log",
        "model.layers.0.self_attn.k_norm.weight",
        "model.layers.0.mlp.experts.2.up_proj.weight",
        "model.layers.1.mlp.experts.0.gate_proj.weight",
        "lm_head.weight",
    ],
)
def test_missing_tensor_raises(drop, tmp_path):
    config = make_config(True, layer_types=[FULL, LIN])
    _our_model(config, seed=51).save_pretrained(tmp_path)
    state = read_safetensors(tmp_path)
    del state[drop]
    write_safetensors(state, tmp_path)
    with pytest.raises(ContextParallelError, match=r"lacks .*" + drop.replace(".", r"\.")):
        Qwen35ForCausalLM.from_pretrained(tmp_path)


def test_stacked_expert_checkpoint_loads(tmp_path):
    """Expert weights stored as transformers holds them in memory ([E, 2I, H] / [E, H, I]) load as they are."""
    config = make_config(True, layer_types=[LIN, FULL])
    ours = _our_model(config, seed=53)
    state = dict(ours.state_dict())
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    write_safetensors(state, tmp_path)
    config.save_pretrained(tmp_path)
    loaded = Qwen35ForCausalLM.from_pretrained(tmp_path)
    for name, t in state.items():
        assert torch.equal(loaded.state_dict()[name], t), name


def test_unexpected_tensor_raises(tmp_path):
    config = make_config(False, layer_types=[LIN])
    _our_model(config, seed=52).save_pretrained(tmp_path)
    state = read_safetensors(tmp_path)
    state["model.layers.7.mlp.up_proj.weight"] = torch.zeros(2, 2)
    write_safetensors(state, tmp_path)
    with pytest.raises(ContextParallelError, match=r"model\.layers\.7\.mlp\.up_proj\.weight"):
        Qwen35ForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("stored", ["both_equal", "head_only", "both_differ"])
def test_tied_checkpoint_storing_the_head(stored, tmp_path):
    """A tied checkpoint that stores lm_head.weight too loads as transformers loads it: equal to the embedding, or
    alone (it is the embedding then); a head that differs contradicts the tie and is refused with the fix."""
    config = make_config(False, layer_types=[LIN, FULL], tie_word_embeddings=True)
    ours = _our_model(config, seed=57)
    ours.save_pretrained(tmp_path)
    state = read_safetensors(tmp_path)
    embedding = state["model.embed_tokens.weight"]
    state["lm_head.weight"] = embedding.clone() + (stored == "both_differ")
    if stored == "head_only":
        del state["model.embed_tokens.weight"]
    write_safetensors(state, tmp_path)
    if stored == "both_differ":
        with pytest.raises(
            ContextParallelError, match=r'stores a lm_head\.weight that differs.*"tie_word_embeddings": false'
        ):
            Qwen35ForCausalLM.from_pretrained(tmp_path)
        return
    loaded = Qwen35ForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.model.embed_tokens.weight, embedding)
    ids = random_row(config, [4, 6], seed=3)
    torch.testing.assert_close(loaded(ids, [4, 6]).logits, ours(ids, [4, 6]).logits, rtol=0, atol=0)


def test_mixed_dtype_checkpoint_loads_in_the_config_dtype(tmp_path):
    """Without a dtype, every floating-point tensor takes transformers' "auto" dtype (the config's), so a checkpoint
    with one tensor stored in another dtype runs; an explicit dtype wins."""
    config = make_config(True, layer_types=[LIN, FULL])
    ours = _our_model(config, seed=59).to(torch.bfloat16)
    ours.save_pretrained(tmp_path)
    state = read_safetensors(tmp_path)
    state["model.layers.1.mlp.gate.weight"] = state["model.layers.1.mlp.gate.weight"].float()
    write_safetensors(state, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = Qwen35ForCausalLM.from_pretrained(tmp_path)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    ids = random_row(config, [5, 4], seed=4)
    torch.testing.assert_close(loaded(ids, [5, 4]).logits, ours(ids, [5, 4]).logits, rtol=0, atol=0)
    explicit = Qwen35ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert {p.dtype for p in explicit.parameters()} == {torch.float32}


# --------------------------------------------------------------------------------------------------------
# 4. Activation checkpointing


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_activation_checkpointing_same_logits_and_grads(moe, tmp_path):
    config = make_config(moe, layer_types=[LIN, FULL, LIN], tie_word_embeddings=not moe)
    _, plain = build_pair(config, tmp_path, seed=61)
    wrapped = Qwen35ForCausalLM.from_pretrained(tmp_path / "hf")
    keys_before = list(wrapped.state_dict())
    assert apply_activation_checkpointing(wrapped) is wrapped
    assert all(type(layer).__name__ == "CheckpointWrapper" for layer in wrapped.model.layers)
    assert list(wrapped.state_dict()) == keys_before  # checkpoints saved from a wrapped model keep HF names

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
    assert relative_max(logits[1], logits[0]) <= 1e-6
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        assert relative_max(grads[1][name], g) <= 1e-6, name
        if not torch.equal(grads[1][name], g):
            record("activation checkpointing", relative_max(grads[1][name], g))


# --------------------------------------------------------------------------------------------------------
# 5. MoE experts and router


def _naive_experts(experts: Qwen35Experts, x, topk_experts, topk_weights):
    inter = experts.down_proj.size(-1)
    rows = []
    for n in range(x.size(0)):
        y = torch.zeros_like(x[n])
        for k in range(topk_experts.size(1)):
            e = int(topk_experts[n, k])
            gate = experts.gate_up_proj[e, :inter] @ x[n]
            up = experts.gate_up_proj[e, inter:] @ x[n]
            y = y + topk_weights[n, k] * (experts.down_proj[e] @ (F.silu(gate) * up))
        rows.append(y)
    return torch.stack(rows)


@pytest.mark.parametrize(("num_experts", "top_k"), [(4, 2), (8, 2), (6, 3), (5, 1)])
def test_experts_looped_matches_naive(num_experts, top_k):
    config = make_config(True, num_experts=num_experts, num_experts_per_tok=top_k)
    torch.manual_seed(num_experts * 10 + top_k)
    router, experts = Qwen35Router(config), Qwen35Experts(config)
    randomize_(router, 1)
    randomize_(experts, 2)
    x = torch.randn(13, config.hidden_size, requires_grad=True)
    weights, chosen = router(x)
    assert chosen.shape == (13, top_k) and weights.shape == (13, top_k)
    if num_experts == 8:  # an expert that gets no token must be skipped cleanly
        chosen = chosen.where(chosen != 7, (chosen + 1) % 7)
        chosen[:, 1] = torch.where(chosen[:, 1] == chosen[:, 0], (chosen[:, 0] + 1) % 7, chosen[:, 1])
        assert 7 not in chosen

    looped = experts._looped(x, chosen, weights)
    torch.testing.assert_close(experts(x, chosen, weights), looped, rtol=0, atol=0)  # CPU fp32 takes the loop
    naive = _naive_experts(experts, x, chosen, weights)
    assert relative_max(looped.detach(), naive.detach()) < 1e-6

    params = [x, experts.gate_up_proj, experts.down_proj, router.weight]
    upstream = torch.randn_like(looped)
    got = torch.autograd.grad((looped * upstream).sum(), params, retain_graph=True)
    ref = torch.autograd.grad((naive * upstream).sum(), params)
    for a, b in zip(got[:3], ref[:3], strict=True):
        assert relative_max(a, b) < 1e-6
    if top_k == 1:  # the one weight is always 1: no gradient reaches the router
        assert got[3].abs().max() < 1e-6 and ref[3].abs().max() < 1e-6
    else:
        assert relative_max(got[3], ref[3]) < 1e-6
    if num_experts == 8:
        assert (got[1][7] == 0).all() and (got[2][7] == 0).all()


@pytest.mark.parametrize(("num_experts", "top_k"), [(4, 2), (8, 2), (8, 1), (6, 3)])
def test_router_topk_normalization(num_experts, top_k):
    config = make_config(True, num_experts=num_experts, num_experts_per_tok=top_k)
    router = randomize_(Qwen35Router(config), num_experts + top_k)
    x = torch.randn(17, config.hidden_size, generator=torch.Generator().manual_seed(top_k))
    weights, chosen = router(x)

    probs = torch.softmax(x @ router.weight.t(), dim=-1)
    ref_probs, ref_idx = probs.topk(top_k, dim=-1)
    assert torch.equal(chosen, ref_idx)
    torch.testing.assert_close(weights, ref_probs / ref_probs.sum(-1, keepdim=True), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(weights.sum(-1), torch.ones(17))
    assert (weights[:, :-1] >= weights[:, 1:]).all()  # sorted, largest first
    if top_k == 1:
        assert (weights == 1).all()

    hf_router = Qwen3_5MoeTopKRouter(config)
    hf_router.weight.data.copy_(router.weight.data)
    _, hf_weights, hf_idx = hf_router(x)
    assert torch.equal(chosen, hf_idx)
    torch.testing.assert_close(weights, hf_weights, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------------------
# 6. Bad input


@pytest.fixture(scope="module")
def small_model():
    torch.manual_seed(0)
    return Qwen35ForCausalLM(make_config(False, layer_types=[LIN, FULL]))


def test_batch_of_two_raises(small_model):
    ids = torch.randint(0, 96, (2, 8))
    with pytest.raises(ContextParallelError, match="batch size 2"):
        small_model(ids, [8])
    with pytest.raises(ContextParallelError, match="batch size 2"):
        small_model(ids, [4, 4])


@pytest.mark.parametrize("seq_lens", [[3, 4], [5, 5], [9], [8, 0, 1]])
def test_seq_lens_not_summing_to_length_raise(small_model, seq_lens):
    with pytest.raises(ContextParallelError):
        small_model(torch.randint(0, 96, (8,)), seq_lens)


def test_other_bad_forward_arguments_raise(small_model):
    ids = torch.randint(0, 96, (8,))
    with pytest.raises(ContextParallelError, match="exactly one"):
        small_model(None, [8])
    with pytest.raises(ContextParallelError, match="exactly one"):
        small_model(ids, [8], inputs_embeds=torch.randn(8, 32))
    with pytest.raises(ContextParallelError, match="position_ids"):
        small_model(ids, [8], position_ids=torch.arange(7))
    with pytest.raises(ContextParallelError, match="labels"):
        small_model(ids, [8], labels=torch.zeros(7, dtype=torch.long))
    # a batch of two is never cut to its first row, whichever argument carries it
    with pytest.raises(ContextParallelError, match=r"inputs_embeds has batch size 2 \(shape \(2, 8, "):
        small_model(None, [8], inputs_embeds=small_model.model.embed_tokens(ids).detach().expand(2, -1, -1))
    with pytest.raises(ContextParallelError, match="labels has batch size 2"):
        small_model(ids, [8], labels=torch.stack([ids, ids]))
    with pytest.raises(ContextParallelError, match="must have 1 or 2"):
        small_model(ids[None, None], [8])
    vocab = small_model.config.vocab_size
    with pytest.raises(ContextParallelError, match=f"label {vocab} is outside the vocabulary of {vocab}"):
        small_model(ids, [8], labels=torch.full((8,), vocab))
    with pytest.raises(ContextParallelError, match=r"input_ids holds token 96, outside the vocabulary \[0, 96\)"):
        small_model(torch.cat([ids[:-1], torch.tensor([96])]), [8])
    with pytest.raises(ContextParallelError, match=r"labels must hold integer token ids, got dtype torch\.float32"):
        small_model(ids, [8], labels=ids.float())
    with pytest.raises(ContextParallelError, match=r"position_ids \(2, 8\) must be \[T\], \[1, T\] or \[3, T\]"):
        small_model(ids, [8], position_ids=torch.arange(8).expand(2, -1))
    # lengths that do not cover the tokens held: named as such, not as a padding problem
    with pytest.raises(ContextParallelError, match="seq_lens sum to 9 tokens but this rank holds 8"):
        small_model(ids, [4, 5])
    # a row given as [1, T] or as embeddings is fine and gives the same logits
    with torch.no_grad():
        ref = small_model(ids, [3, 5]).logits
        torch.testing.assert_close(small_model(ids[None], [3, 5]).logits, ref, rtol=0, atol=0)
        embeds = small_model.model.embed_tokens(ids)
        torch.testing.assert_close(small_model(None, [3, 5], inputs_embeds=embeds[None]).logits, ref, rtol=0, atol=0)


def test_load_text_config_rejects_other_models(tmp_path):
    llama = LlamaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ContextParallelError, match="llama"):
        load_text_config(llama)
    llama.save_pretrained(tmp_path)
    with pytest.raises(ContextParallelError, match=r"not a Qwen3\.5 config"):
        load_text_config(str(tmp_path))
    with pytest.raises(ContextParallelError):
        Qwen35ForCausalLM(llama)


def test_load_text_config_accepts_qwen35_configs():
    text = make_config(False)
    assert load_text_config(text) is text
    moe = make_config(True)
    assert load_text_config(moe) is moe
    vl = Qwen3_5Config(text_config=text.to_dict())
    assert load_text_config(vl).model_type == "qwen3_5_text"
    assert load_text_config(vl).hidden_size == text.hidden_size


def test_rotary_frequencies_stay_fp32_under_a_dtype_cast():
    """``model.to(bfloat16)`` must not round the rotary frequencies: at position 30000 a bf16-rounded frequency
    turns the angle by up to ~100 rad. The cos/sin tables of a bf16 model equal the fp32 model's, cast once."""
    config = make_config(False, layer_types=[FULL, LIN], rope_parameters=dict(BASE_ROPE))
    model = Qwen35ForCausalLM(config)
    positions = torch.tensor([0, 7, 4095, 30000, 131071])
    ref_cos, ref_sin = model.model.rotary_emb(positions, torch.float32)
    model.to(torch.bfloat16)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    cos, sin = model.model.rotary_emb(positions, torch.bfloat16)
    torch.testing.assert_close(cos, ref_cos.bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(sin, ref_sin.bfloat16(), rtol=0, atol=0)
