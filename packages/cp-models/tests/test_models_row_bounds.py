"""The row's kernel boundaries are built once per forward and every layer's kernel gets that one object.

On CPU the kernels run their torch paths, which need no device boundaries. Here cp_core's kernel choice is made to
say "fla" (recurrences) and "varlen" (attention), and its kernel wrappers record the boundaries they are handed and
run the torch reference instead: the models then take the GPU code path up to the kernel call, and the result must
equal the plain torch run exactly.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from cp_core.conv import causal_conv1d_torch
from cp_core.gated_delta import GatedDecay, chunk_gated_delta_rule_torch
from cp_core.packing import position_ids_from_seq_lens
from cp_core.ssd import chunk_ssd_torch
from cp_core.varlen_attention import torch_varlen_attention
from cp_models import NemotronHForCausalLM, Qwen35ForCausalLM
from cp_models.presets import tiny_nemotron_h_config, tiny_qwen35_config, tiny_qwen35_moe_config

# Modules by import path: ``cp_core.ssd`` as an attribute is the function cp_core exports under that name.
conv_module, bounds_module, gated_delta_module, backends_module, ssd_module, attention_module = (
    importlib.import_module(f"cp_core.{name}")
    for name in ("conv", "document_bounds", "gated_delta", "recurrent_backends", "ssd", "varlen_attention")
)
SEQ_LENS = [37, 64, 90, 1]  # a document over a chunk boundary, one exactly a chunk, one of a single token


class KernelLog:
    """What the faked GPU kernel wrappers were handed, and how often boundaries were built."""

    def __init__(self):
        self.bounds: list = []  # DocumentBounds handed to conv / gated delta / SSD
        self.attention_cu: list[torch.Tensor] = []  # cu_seqlens handed to the varlen attention kernel
        self.builds = 0


def _fake_gpu_kernels(monkeypatch, log: KernelLog) -> None:
    def fla(*args, **kwargs) -> str:
        return "fla"

    def conv(x, weight, bias, activation, seq_lens, halo, tokens_before, bounds=None):
        log.bounds.append(bounds)
        positions = position_ids_from_seq_lens(list(bounds.seq_lens))
        return causal_conv1d_torch(x, weight, bias, activation, positions, halo)

    def gated_delta(q, k, v, g, beta, *, bounds, scale, initial_state, qk_l2norm):
        log.bounds.append(bounds)
        g = g.log_decay() if isinstance(g, GatedDecay) else g  # what fla computes inside its kernel
        return chunk_gated_delta_rule_torch(
            q, k, v, g, beta, seq_lens=bounds.seq_lens, scale=scale, initial_state=initial_state, qk_l2norm=qk_l2norm
        )

    def ssd(x, dt, A, B, C, *, bounds, D, initial_state):
        log.bounds.append(bounds)
        return chunk_ssd_torch(x, dt, A, B, C, seq_lens=bounds.seq_lens, D=D, initial_state=initial_state)

    def attention(q, k, v, cu_q, cu_k, max_q, max_k, scale, sliding_window):
        log.attention_cu.append(cu_q)
        assert cu_k is cu_q and max_q == max_k == max(SEQ_LENS)
        return torch_varlen_attention(q, k, v, cu_q, scale=scale, sliding_window=sliding_window)

    real_build = bounds_module.build_document_bounds

    def counted_build(*args, **kwargs):
        log.builds += 1
        return real_build(*args, **kwargs)

    for module in (bounds_module, conv_module, gated_delta_module, ssd_module, backends_module):
        if hasattr(module, "build_document_bounds"):
            monkeypatch.setattr(module, "build_document_bounds", counted_build)
    for module in (conv_module, gated_delta_module, ssd_module):
        monkeypatch.setattr(module, "resolve_recurrent_backend", fla)
    monkeypatch.setattr(conv_module, "_fla_causal_conv1d", conv)
    monkeypatch.setattr(gated_delta_module, "_chunk_gated_delta_rule_fla", gated_delta)
    monkeypatch.setattr(ssd_module, "_ssd_fla", ssd)
    monkeypatch.setattr(attention_module, "resolve_attention_backend", lambda backend, q: "varlen")
    monkeypatch.setattr(attention_module, "_torch_varlen_kernel", attention)


def _step(model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    ids = torch.arange(sum(SEQ_LENS)) * 7 % model.config.vocab_size
    loss = -model(ids, SEQ_LENS, labels=ids).token_log_probs.sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


MODELS = {
    "qwen3_5": lambda: Qwen35ForCausalLM(tiny_qwen35_config(256)),
    "qwen3_5_moe": lambda: Qwen35ForCausalLM(tiny_qwen35_moe_config(256)),
    "nemotron_h": lambda: NemotronHForCausalLM(tiny_nemotron_h_config(256)),
}
# Kernel calls one forward + backward makes: conv + gated delta per GDN layer, conv + SSD per Mamba-2 layer.
RECURRENT_CALLS = {"qwen3_5": 2 * 3, "qwen3_5_moe": 2 * 3, "nemotron_h": 2 * 2}
ATTENTION_CALLS = 1


@pytest.mark.parametrize("name", list(MODELS))
def test_one_build_of_the_row_bounds_serves_every_layer(name, monkeypatch):
    torch.manual_seed(0)
    model = MODELS[name]().double()
    reference_loss, reference_grads = _step(model)

    log = KernelLog()
    _fake_gpu_kernels(monkeypatch, log)
    loss, grads = _step(model)

    assert log.builds == 1  # one DocumentBounds for the row (without CP the shard's and the row's are one)
    assert len(log.bounds) == RECURRENT_CALLS[name] and len(log.attention_cu) == ATTENTION_CALLS
    bounds = log.bounds[0]
    assert all(b is bounds for b in log.bounds)
    assert all(cu is bounds.cu_seqlens_int32 for cu in log.attention_cu)
    assert bounds.seq_lens == tuple(SEQ_LENS)

    assert torch.equal(loss, reference_loss)
    assert grads.keys() == reference_grads.keys() and len(grads) > 10
    for n, g in grads.items():
        assert torch.equal(g, reference_grads[n]), n

    _step(model)  # the next row builds its own bounds, once
    assert log.builds == 2
