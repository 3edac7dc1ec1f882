"""Nemotron-H under context parallelism on real gloo groups of 2 and 4 ranks: the whole causal LM (Mamba-2,
attention, MLP, MoE, the chunked log-prob loss) sharded over the sequence gives the unsharded model's outputs and
every parameter gradient, for both Mamba-2 CP strategies (state passing and head-parallel all-to-all), with and
without activation checkpointing; bad setups raise the same ContextParallelError on every rank instead of hanging
one of them."""

from __future__ import annotations

import dataclasses
import functools
import random

import pytest
import torch
from cp_cases import (
    SEQ_DIMS,
    TOTAL,
    VOCAB,
    assert_every_rank_raises,
    make_inputs,
    plain_name,
    with_workers,
)
from nemotron_h_dt import draw_dt_bias
from transformers import NemotronHConfig

from cp_core import ContextParallelError, CPTopology, PackedRowMetadata, build_packed_metadata
from cp_core.head_parallel import check_head_parallel, local_groups, local_heads
from cp_core.testing import (
    CommCounter,
    GlooWorkers,
    check_cp_parity,
    layout_cases,
    random_seq_lens,
)
from cp_models import (
    ContextParallelAttention,
    ContextParallelModule,
    NemotronHForCausalLM,
    apply_activation_checkpointing,
    set_context_parallel_attributes,
)
from cp_models.nemotron_h_mamba import NemotronHMamba2Mixer
from cp_models.presets import tiny_nemotron_h_config

pytestmark = pytest.mark.usefixtures("one_thread")
STYLES = ("state_passing", "a2a")

# Overrides of the tiny preset (cp_models.presets.TINY_NEMOTRON_H): narrower; attention 4 query / 2 KV heads (cp=2
# splits the KV heads, cp=4 replicates each twice).
_COMMON = dict(hidden_size=32, head_dim=8, intermediate_size=48, mamba_head_dim=4, ssm_state_size=8)

CONFIGS = {
    # Mamba, attention, Mamba, MLP; 2 B/C groups: a2a splits them at cp=2 and replicates each twice at cp=4.
    "hybrid": dict(_COMMON, hybrid_override_pattern="M*M-", n_groups=2),
    # One B/C group (replicated to every rank under a2a), MoE with 4 experts top-2 and a shared expert.
    "moe_groups1": dict(
        _COMMON,
        hybrid_override_pattern="ME*M",
        n_groups=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=16,
    ),
    # 4 B/C groups: a2a gives each rank 2 groups at cp=2 and one at cp=4; no conv bias, projection biases; time
    # steps clamped to [4e-3, 5e-2] (every third head's dt_bias under the lower bound).
    "groups4": dict(
        _COMMON,
        hybrid_override_pattern="M*M",
        n_groups=4,
        use_conv_bias=False,
        use_bias=True,
        time_step_limit=(4e-3, 5e-2),
    ),
}


def make_config(name: str, **overrides) -> NemotronHConfig:
    return tiny_nemotron_h_config(VOCAB, **{**CONFIGS[name], **overrides})


@torch.no_grad()
def randomize_(model: torch.nn.Module) -> None:
    """Moderate random weights everywhere, so that every path carries signal: matrices N(0, 0.2), norm weights
    around 1, a nonzero router correction bias, Mamba decays A = exp(A_log) in [0.05, 0.2] with dt_bias as
    transformers draws it (time steps ~1e-3-0.1, some clamped where the config's time_step_limit has a positive
    lower bound), so a state keeps most of itself across a shard and what crosses a shard cut matters
    (test_parity_detects_mamba_without_cp checks that it does)."""
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            p.copy_(torch.empty_like(p).uniform_(0.05, 0.2).log())
        elif leaf == "dt_bias":
            p.copy_(draw_dt_bias(model.config, p.numel()))
        elif p.dim() >= 2:
            p.normal_(0.0, 0.2)
        elif name.endswith("norm.weight") or name.endswith("norm_f.weight"):
            p.normal_(1.0, 0.2)
        else:
            p.normal_(0.0, 0.2)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.normal_(0.0, 0.05)


def build_model(
    config_name: str, style: str, checkpointing: bool = False, dtype: torch.dtype = torch.float32, **overrides
) -> NemotronHForCausalLM:
    """The module factory (the harness seeds torch before calling it, on every rank and for the reference)."""
    model = NemotronHForCausalLM(make_config(config_name, **overrides), mamba_cp_style=style)
    randomize_(model)
    model.to(dtype)
    if checkpointing:
        apply_activation_checkpointing(model)
    return model


# --------------------------------------------------------------------------------------------------------
# Cases run on the workers (module level, so that they are importable by name)


def lm_case(
    module: NemotronHForCausalLM,
    metadata: PackedRowMetadata,
    topology: CPTopology,
    *,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    output: str = "token_log_probs",
    checkpoint_after: bool = False,
    attention_cp_style: str = "auto",
) -> torch.Tensor:
    set_context_parallel_attributes(module, topology, attention_cp_style=attention_cp_style)
    if attention_cp_style != "auto" and topology.size > 1:
        assert {m.attention_cp_style for m in module.modules() if isinstance(m, ContextParallelAttention)} == {
            attention_cp_style
        }
    if checkpoint_after:  # the other order: checkpointing wraps layers whose CP attributes are already set
        apply_activation_checkpointing(module)
    # Every token mixer (Mamba and attention) got the topology, also through checkpoint wrappers, and every Mamba
    # layer runs the model's strategy.
    kinds = module.config.layers_block_type
    mixers = [m for m in module.modules() if isinstance(m, ContextParallelModule)]
    assert len(mixers) == sum(kind in ("linear_attention", "full_attention") for kind in kinds)
    assert all(m.cp_topology.size == topology.size and m.cp_topology.rank == topology.rank for m in mixers)
    mamba = [m for m in mixers if isinstance(m, NemotronHMamba2Mixer)]
    assert len(mamba) == kinds.count("linear_attention")
    assert all(m.cp_style == module.mamba_cp_style for m in mamba)
    out = module(input_ids, metadata.seq_lens, labels=labels, return_logits=output == "logits")
    assert out.token_log_probs is not None and out.token_log_probs.shape == input_ids.shape
    assert (out.logits is None) == (output != "logits")
    return getattr(out, output)


# --------------------------------------------------------------------------------------------------------
# Pools and bookkeeping


WORST: dict[str, tuple[float, str]] = {}  # largest relative difference per variant (printed with -s)


@pytest.fixture(scope="module", autouse=True)
def _print_worst():
    yield
    for variant, (rel, name) in sorted(WORST.items()):
        print(f"\n[nemotron-h-cp] {variant}: worst {rel:.2e} ({name})")


# --------------------------------------------------------------------------------------------------------
# Parity: CP = 2 and 4 against CP = 1

ALL = None
SUBSET = ("cuts_on_boundaries", "spans_all_ranks", "tiny_documents")

# name: (config, case, layouts: None for every layout_cases layout plus random ones)
VARIANTS = {
    "hybrid": ("hybrid", {}, lm_case, ALL),
    "hybrid_logits": ("hybrid", {}, functools.partial(lm_case, output="logits"), ("cuts_inside_documents",)),
    "moe_groups1": ("moe_groups1", {}, lm_case, SUBSET),
    "groups4": ("groups4", {}, lm_case, ("single_document", "mixed_random")),
    # Activation checkpointing applied first (the factory), CP attributes set through the wrappers (the case).
    "hybrid_checkpointed": ("hybrid", {"checkpointing": True}, lm_case, ("spans_all_ranks", "mixed_random")),
    "moe_checkpointed": ("moe_groups1", {"checkpointing": True}, lm_case, ("cuts_inside_documents",)),
    # Attention by all-gathered keys and values.
    "hybrid_kv_gather": ("hybrid", {}, functools.partial(lm_case, attention_cp_style="kv_gather"), SUBSET),
    # Keys and values passed around the ring.
    "hybrid_kv_ring": ("hybrid", {}, functools.partial(lm_case, attention_cp_style="kv_ring"), SUBSET),
    # The other order: CP attributes first, then checkpointing.
    "hybrid_checkpoint_after_cp": (
        "hybrid",
        {},
        functools.partial(lm_case, checkpoint_after=True),
        ("tiny_documents",),
    ),
}

# fp32, relative to each tensor's largest entry. The sharded run reorders only roundings (the per-document scans
# restart from a passed state, or run on another rank's full row); observed <= 5.2e-6 everywhere.
FP32_RTOL = 1e-5


def _layouts(cp: int, wanted) -> dict[str, list[int]]:
    layouts = layout_cases(TOTAL[cp], cp)
    if wanted is not None:
        return {name: layouts[name] for name in wanted}
    rng = random.Random(cp)
    for i in range(2):  # random cuts on top of the named layouts
        layouts[f"random_{i}"] = random_seq_lens(TOTAL[cp], rng)
    return layouts


def run_variant(workers: GlooWorkers, variant: str, style: str) -> None:
    cp = workers.world_size
    config_name, factory_kwargs, case, wanted = VARIANTS[variant]
    factory = functools.partial(build_model, config_name, style, **factory_kwargs)
    reference = factory()
    expected = {
        "out",
        *(f"grad.param.{n}".replace("._checkpoint_wrapped_module", "") for n, _ in reference.named_parameters()),
    }
    failures = []
    for index, (layout, seq_lens) in enumerate(_layouts(cp, wanted).items()):
        seed = 1000 + 100 * cp + index
        report = check_cp_parity(
            workers,
            case,
            seq_lens=seq_lens,
            inputs=make_inputs(TOTAL[cp], seed),
            seq_dims=SEQ_DIMS,
            module_factory=factory,
            seed=seed,
        )
        got = {plain_name(n) for n in report.relative}
        assert got == expected, sorted(got ^ expected)  # the output and every parameter's gradient
        name, rel = report.worst
        key = f"{variant} {style} cp{cp}"
        if rel >= WORST.get(key, (0.0, ""))[0]:
            WORST[key] = (rel, f"{name} @ {layout}")
        try:
            report.assert_close(rtol=FP32_RTOL)
        except AssertionError as exc:
            failures.append(f"{layout} {seq_lens}: {exc}")
    assert not failures, f"cp={cp} {variant} {style}:\n" + "\n".join(failures)


@with_workers
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_nemotron_h_cp_parity(workers, variant, style):
    run_variant(workers, variant, style)


def _mamba_without_cp_case(module, metadata, topology, *, input_ids, labels):
    """Deliberately wrong CP: Mamba layers left unsharded (no conv halo, no state passing; each shard restarts)."""
    set_context_parallel_attributes(module, topology)
    for layer in module.modules():
        if isinstance(layer, NemotronHMamba2Mixer):
            layer.cp_topology = CPTopology.single()
    return module(input_ids, metadata.seq_lens, labels=labels).token_log_probs


def _a2a_local_boundaries_case(module, metadata, topology, *, input_ids, labels):
    """Deliberately wrong a2a: the full-row conv and scan restart at every shard cut, as if each shard's
    documents were the row's (the mistake of reusing this rank's local boundaries after the all-to-all)."""
    set_context_parallel_attributes(module, topology)
    cut = tuple(
        n
        for rank in range(metadata.cp_size)
        for n in build_packed_metadata(metadata.seq_lens, rank, metadata.cp_size).local_seq_lens
    )
    for layer in module.modules():
        if isinstance(layer, NemotronHMamba2Mixer):
            layer.forward = functools.partial(_forward_with_boundaries, layer, seq_lens=cut)
    return module(input_ids, metadata.seq_lens, labels=labels).token_log_probs


def _forward_with_boundaries(layer, hidden, meta, *, seq_lens):
    return NemotronHMamba2Mixer.forward(layer, hidden, dataclasses.replace(meta, seq_lens=seq_lens))


@with_workers
def test_parity_detects_broken_mamba_cp(workers):
    """The weights are strong enough that what crosses a shard cut matters: dropping the Mamba layers' CP (both
    strategies) or giving the head-parallel scan the shard-local boundaries breaks parity far beyond the
    tolerance; with the row tiled by shard-sized documents nothing crosses, and it holds."""
    cp = workers.world_size
    total = TOTAL[cp]
    inputs = make_inputs(total, seed=3)
    for style, case in (
        ("state_passing", _mamba_without_cp_case),
        ("a2a", _mamba_without_cp_case),
        ("a2a", _a2a_local_boundaries_case),
    ):
        factory = functools.partial(build_model, "hybrid", style)
        for seq_lens in ([total], layout_cases(total, cp)["spans_all_ranks"]):
            report = check_cp_parity(
                workers, case, seq_lens=seq_lens, inputs=inputs, seq_dims=SEQ_DIMS, module_factory=factory
            )
            assert report.relative["out"] > 1e-2, (style, case.__name__, seq_lens, report.relative["out"])
        report = check_cp_parity(
            workers, case, seq_lens=[total // cp] * cp, inputs=inputs, seq_dims=SEQ_DIMS, module_factory=factory
        )
        report.assert_close(rtol=FP32_RTOL)


def test_strategies_agree_unsharded_and_checkpointing_changes_nothing():
    """Without CP both strategies are the same computation, and the checkpoint-wrapped model gives the plain
    model's outputs and gradients, so the checkpointed parity above compares the same function."""
    inputs = make_inputs(32, seed=7)
    results = []
    for style, checkpointing in (("state_passing", False), ("a2a", False), ("a2a", True)):
        torch.manual_seed(0)
        model = build_model("moe_groups1", style, checkpointing=checkpointing)
        set_context_parallel_attributes(model, CPTopology.single())
        out = model(inputs["input_ids"], [10, 2, 20], labels=inputs["labels"]).token_log_probs
        out.sum().backward()
        grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in model.named_parameters()}
        results.append((out.detach(), grads))
    out0, grads0 = results[0]
    for out, grads in results[1:]:
        assert torch.equal(out, out0)
        assert grads.keys() == grads0.keys()
        for name, grad in grads0.items():
            assert torch.equal(grad, grads[name]), name


# --------------------------------------------------------------------------------------------------------
# Traffic: the bytes each strategy sends, counted from the tensors handed to the collectives


def _mamba_layer_bytes(topology: CPTopology, config_name: str, style: str, seq_lens: list[int]) -> int:
    """Bytes this rank sends for one Mamba layer, forward and backward (fp32)."""
    torch.manual_seed(0)
    model = build_model(config_name, style)
    set_context_parallel_attributes(model, topology)
    mixer = model.model.layers[0].mixer
    assert isinstance(mixer, NemotronHMamba2Mixer)
    local = sum(seq_lens) // topology.size
    meta = build_packed_metadata(seq_lens, topology.rank, topology.size)
    hidden = torch.randn(local, model.config.hidden_size, requires_grad=True)
    with CommCounter(topology.size) as counter:
        mixer(hidden, meta).sum().backward()
    return counter.total_sent_bytes


def expected_mamba_bytes(config, style: str, total: int, cp: int, rank: int, doc_continues: bool) -> int:
    """The traffic documented in docs/cp-models.md, fp32 (4 bytes an element)."""
    heads, dim, groups, state = config.mamba_num_heads, config.mamba_head_dim, config.n_groups, config.ssm_state_size
    local = total // cp
    if style == "a2a":  # x, B, C (groups replicated up to cp), dt to heads; y back; the same again in backward
        to_heads = local * (heads * dim + 2 * max(groups, cp) * state + heads) * 4
        back = local * heads * dim * 4
        return 2 * (to_heads * (cp - 1) // cp + back * (cp - 1) // cp)
    if not doc_continues:
        return 0
    halo = (config.conv_kernel - 1) * (heads * dim + 2 * groups * state) * 4
    passed = heads * dim * state * 4  # one fp32 SSD state
    return (halo + passed) * ((rank < cp - 1) + (rank > 0))  # to the next rank forward, to the previous backward


@with_workers
@pytest.mark.parametrize("config_name", ["hybrid", "moe_groups1"])
def test_mamba_traffic_matches_the_documented_bytes(workers, config_name):
    cp = workers.world_size
    total = TOTAL[cp]
    config = make_config(config_name)
    one_doc, on_cuts = [total], [total // cp] * cp
    for style in STYLES:
        for seq_lens, continues in ((one_doc, True), (on_cuts, False)):
            got = workers.run(_mamba_layer_bytes, config_name, style, seq_lens, timeout_s=120)
            want = [expected_mamba_bytes(config, style, total, cp, r, continues) for r in range(cp)]
            assert got == want, (style, seq_lens, got, want)


# --------------------------------------------------------------------------------------------------------
# Setup validation: every rank raises the same ContextParallelError, none is left in a collective


def _set_cp(
    topology: CPTopology, config_name: str, style: str, overrides: dict, attention_cp_style: str = "ulysses"
) -> str:
    """set_context_parallel_attributes on a model with these overrides; on error, prove nothing was half-set."""
    model = build_model(config_name, style, **overrides)
    try:
        set_context_parallel_attributes(model, topology, attention_cp_style=attention_cp_style)
    except Exception:
        layers = [m for m in model.modules() if isinstance(m, ContextParallelModule)]
        assert layers and all(m.cp_topology.size == 1 for m in layers), "layers configured before the error"
        raise
    return "ok"


def test_head_parallel_rules_and_ranges():
    """Which heads and B/C groups each rank holds under a2a: contiguous head blocks; groups split when cp divides
    them, else the one group the rank's heads read (every head of the block reads it)."""
    for heads, groups, cp in ((8, 2, 2), (8, 2, 4), (8, 1, 4), (8, 4, 2), (8, 8, 4), (64, 8, 16)):
        check_head_parallel(heads, groups, cp)
        per_group = heads // groups
        for rank in range(cp):
            topology = CPTopology(group=object(), rank=rank, size=cp)  # only rank and size are read
            mine, theirs = local_heads(heads, topology), local_groups(groups, topology)
            assert mine.stop - mine.start == heads // cp and theirs.stop - theirs.start == max(1, groups // cp)
            assert {h // per_group for h in range(mine.start, mine.stop)} <= set(range(theirs.start, theirs.stop))
    for heads, groups, cp, text in ((6, 3, 4, "heads=6"), (6, 3, 2, "groups=3"), (12, 3, 4, "groups=3")):
        with pytest.raises(ContextParallelError, match=f"{text}.*cp={cp}|cp={cp}.*{text}"):
            check_head_parallel(heads, groups, cp)
    with pytest.raises(ContextParallelError, match="not a multiple"):
        check_head_parallel(6, 4, 1)


@with_workers
def test_a2a_heads_or_groups_that_do_not_split_are_rejected(workers):
    cp = workers.world_size
    # 6 Mamba heads in 3 groups: cp=4 does not divide the heads; cp=2 does, but 2 and 3 groups do not nest.
    overrides = {"mamba_num_heads": 6, "n_groups": 3}
    must_name = ["heads=6", "cp=4"] if cp == 4 else ["groups=3", "cp=2"]
    assert_every_rank_raises(workers, _set_cp, "hybrid", "a2a", overrides, must_name=["Mamba-2", *must_name])
    # The controls: state passing has no head rule; a2a takes the default heads (8 in 2 groups).
    assert workers.run(_set_cp, "hybrid", "state_passing", overrides, timeout_s=60) == ["ok"] * cp
    assert workers.run(_set_cp, "hybrid", "a2a", {}, timeout_s=60) == ["ok"] * cp


@with_workers
def test_attention_heads_that_do_not_split_are_rejected_under_ulysses(workers):
    cp = workers.world_size
    overrides = {"num_attention_heads": 6, "num_key_value_heads": 3}
    must_name = ["q_heads=6", "cp=4"] if cp == 4 else ["kv_heads=3", "cp=2"]
    for style in STYLES:
        assert_every_rank_raises(workers, _set_cp, "hybrid", style, overrides, must_name=must_name)
    # Unless attention gathers the keys and values ("auto" picks that for them).
    for attention in ("auto", "kv_gather"):
        assert workers.run(_set_cp, "hybrid", "state_passing", overrides, attention, timeout_s=60) == ["ok"] * cp


def _forward_with_bad_input(topology: CPTopology, style: str, bad_ranks: tuple[int, ...], what: str) -> int:
    """A cp forward and backward of the hybrid model where ranks ``bad_ranks`` pass a malformed ``what``."""
    torch.manual_seed(0)
    local = 8
    model = build_model("hybrid", style)
    set_context_parallel_attributes(model, topology)
    ids = torch.randint(0, VOCAB, (local,))
    kwargs: dict = {"labels": ids.clone()}
    if topology.rank in bad_ranks and what == "position_ids":
        kwargs["position_ids"] = torch.arange(local - 1)
    elif topology.rank in bad_ranks and what == "labels_batch":
        kwargs["labels"] = torch.stack([ids, ids])
    out = model(ids, [3, topology.size * local - 3], **kwargs)
    out.token_log_probs.sum().backward()
    return local


@with_workers
@pytest.mark.parametrize("style", STYLES)
def test_one_rank_with_a_bad_input_stops_every_rank(workers, style):
    """Nemotron-H has no positions, yet a wrong position_ids shape on one rank, or labels for a batch of two, stop
    every rank at once (that rank with its error, the others naming it) instead of leaving them in an exchange."""
    cp = workers.world_size
    for failing, what, says in (
        ((cp - 1,), "position_ids", "position_ids (7,) must be [T], [1, T] or [3, T] with this rank's T = 8"),
        ((0,), "labels_batch", "labels has batch size 2"),
    ):
        workers.assert_failing_ranks_stop_every_rank(
            _forward_with_bad_input, style, failing, what, failing=failing, says=says
        )
    assert workers.run(_forward_with_bad_input, style, (), "none", timeout_s=120) == [8] * cp
