"""Qwen3.5 under context parallelism on real gloo groups of 2 and 4 ranks: the whole causal LM (Gated DeltaNet,
gated attention, MLP or MoE, the chunked log-prob loss) sharded over the sequence gives the unsharded model's
outputs and every parameter gradient, with and without activation checkpointing; bad setups raise the same
ContextParallelError on every rank instead of hanging one of them."""

from __future__ import annotations

import functools
import re

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

from cp_core import ContextParallelError, CPTopology, PackedRowMetadata
from cp_core.testing import GlooWorkers, check_cp_parity, keep_float64_, layout_cases
from cp_models import (
    ContextParallelAttention,
    ContextParallelModule,
    Qwen35ForCausalLM,
    apply_activation_checkpointing,
    set_context_parallel_attributes,
)
from cp_models.presets import tiny_qwen35_config, tiny_qwen35_moe_config
from cp_models.qwen3_5 import Qwen35DecoderLayer, Qwen35GatedDeltaNet

pytestmark = pytest.mark.usefixtures("one_thread")

# --------------------------------------------------------------------------------------------------------
# Tiny configs (module level: the workers rebuild the same models from these names)

# Overrides of the tiny presets (cp_models.presets): narrower, and 4 query / 2 KV heads (cp=2 splits the KV heads,
# cp=4 replicates each twice).
_SMALL = dict(hidden_size=32, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_value_heads=2)

CONFIGS = {
    # 4 layers, the default pattern: 3 GDN layers, then full attention.
    "dense": (tiny_qwen35_config, dict(_SMALL, intermediate_size=64, tie_word_embeddings=False)),
    # GDN with twice as many value heads as key heads (q/k heads repeated), tied embeddings.
    "dense_gdn_v2x_tied": (tiny_qwen35_config, dict(_SMALL, intermediate_size=64, linear_num_value_heads=4)),
    # Sparse MoE (4 experts, top-2, gated shared expert) on a GDN and an attention layer; one KV head (replicated
    # to every rank under Ulysses), GDN value heads 2x key heads.
    "moe": (
        tiny_qwen35_moe_config,
        dict(
            _SMALL,
            num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],
            num_key_value_heads=1,
            linear_num_value_heads=4,
            shared_expert_intermediate_size=16,
            tie_word_embeddings=False,
        ),
    ),
}


def make_config(name: str, **overrides):
    preset, kwargs = CONFIGS[name]
    return preset(VOCAB, **{**kwargs, **overrides})


@torch.no_grad()
def randomize_(model: torch.nn.Module) -> None:
    """Moderate random weights everywhere, so that every path (recurrent states, gates, norms, the router)
    carries signal: matrices N(0, 0.2); norm weights around their identity; GDN decays A = exp(A_log) in
    [0.05, 0.2] (with softplus(a + dt_bias) ~ 0.7-1.3, a state keeps ~7-70% of itself over 10 tokens, so what
    crosses a shard cut matters; test_parity_detects_gdn_without_cp checks that it does)."""
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            p.copy_(torch.empty_like(p).uniform_(0.05, 0.2).log())
        elif leaf == "dt_bias":
            p.normal_(0.0, 0.3)
        elif p.dim() >= 2:
            p.normal_(0.0, 0.2)
        elif name.endswith("linear_attn.norm.weight"):  # GatedRMSNorm: plain weight
            p.normal_(1.0, 0.2)
        else:  # ZeroCenteredRMSNorm: stored as an offset from 1
            p.normal_(0.0, 0.2)


def keep_qwen35_float64_(model: torch.nn.Module) -> None:
    """True fp64 (see cp_core.testing.keep_float64_), also while activation checkpointing recomputes a layer."""
    keep_float64_(model, [m for m in model.modules() if isinstance(m, Qwen35DecoderLayer)])


def build_model(
    config_name: str,
    dtype: torch.dtype = torch.float32,
    checkpointing: bool = False,
    keep_float64: bool = False,
    **overrides,
) -> Qwen35ForCausalLM:
    """The module factory (the harness seeds torch before calling it, on every rank and for the reference)."""
    model = Qwen35ForCausalLM(make_config(config_name, **overrides))
    randomize_(model)
    model.to(dtype)
    if keep_float64:
        keep_qwen35_float64_(model)
    if checkpointing:
        apply_activation_checkpointing(model)
    return model


# --------------------------------------------------------------------------------------------------------
# Cases run on the workers (module level, so that they are importable by name)


def lm_case(
    module: Qwen35ForCausalLM,
    metadata: PackedRowMetadata,
    topology: CPTopology,
    *,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    output: str = "token_log_probs",
    checkpoint_after: bool = False,
    attention_cp_style: str = "auto",
    expect_attention: str | dict[int, str] = "ulysses",
) -> torch.Tensor:
    set_context_parallel_attributes(module, topology, attention_cp_style=attention_cp_style)
    if topology.size > 1:  # the strategy each attention layer resolved to
        attention = [m for m in module.modules() if isinstance(m, ContextParallelAttention)]
        expected = expect_attention if isinstance(expect_attention, str) else expect_attention[topology.size]
        assert attention and {m.attention_cp_style for m in attention} == {expected}
    if checkpoint_after:  # the other order: checkpointing wraps layers whose CP attributes are already set
        apply_activation_checkpointing(module)
    # Every token mixer got the topology, also through checkpoint wrappers.
    mixers = [m for m in module.modules() if isinstance(m, ContextParallelModule)]
    assert len(mixers) == module.config.num_hidden_layers
    assert all(m.cp_topology.size == topology.size and m.cp_topology.rank == topology.rank for m in mixers)
    out = module(input_ids, metadata.seq_lens, labels=labels, return_logits=output == "logits")
    assert out.hidden_states.shape == (input_ids.size(0), module.config.hidden_size)
    assert out.token_log_probs is not None and out.token_log_probs.shape == input_ids.shape
    if output == "logits":
        assert out.logits.shape == (input_ids.size(0), VOCAB)
    else:
        assert out.logits is None
    return getattr(out, output)


# --------------------------------------------------------------------------------------------------------
# Pools and bookkeeping


# Largest relative difference seen per variant and tensor kind (printed at module teardown with -s).
WORST: dict[str, dict[str, tuple[float, str]]] = {}


@pytest.fixture(scope="module", autouse=True)
def _print_worst():
    yield
    for variant, worst in sorted(WORST.items()):
        print(f"\n{variant}: " + ", ".join(f"{k} {r:.2e} ({n})" for k, (r, n) in sorted(worst.items())))


def _record(variant: str, relative: dict[str, float], behind_gdn: set[str]) -> None:
    """Keep the largest relative difference of the output, of the gradients held to 1e-5 in fp32 and of those
    behind a GDN layer."""
    worst = WORST.setdefault(variant, {})
    for name, rel in relative.items():
        key = "out" if name == "out" else "grad behind GDN" if name in behind_gdn else "grad other"
        if rel >= worst.get(key, (0.0, ""))[0]:
            worst[key] = (rel, name)


# --------------------------------------------------------------------------------------------------------
# Parity: CP = 2 and 4 against CP = 1

SUBSET = ("single_document", "cuts_inside_documents", "spans_all_ranks")

# name: (module factory, case, layouts to run: None for every layout_cases layout)
VARIANTS = {
    "dense": (functools.partial(build_model, "dense"), lm_case, None),
    "dense_logits": (
        functools.partial(build_model, "dense"),
        functools.partial(lm_case, output="logits"),
        ("cuts_inside_documents", "tiny_documents"),
    ),
    "dense_gdn_v2x_tied": (functools.partial(build_model, "dense_gdn_v2x_tied"), lm_case, SUBSET),
    "moe": (functools.partial(build_model, "moe"), lm_case, (*SUBSET, "tiny_documents")),
    # Activation checkpointing applied first (the factory), CP attributes set through the wrappers (the case).
    "dense_checkpointed": (functools.partial(build_model, "dense", checkpointing=True), lm_case, SUBSET),
    "moe_checkpointed": (
        functools.partial(build_model, "moe", checkpointing=True),
        lm_case,
        ("spans_all_ranks", "mixed_random"),
    ),
    # Attention by all-gathered keys and values, forced where Ulysses could run ...
    "dense_kv_gather": (
        functools.partial(build_model, "dense"),
        functools.partial(lm_case, attention_cp_style="kv_gather", expect_attention="kv_gather"),
        None,
    ),
    # Keys and values passed around the ring, with checkpointing (the ring runs again in the recomputation).
    "dense_kv_ring_checkpointed": (
        functools.partial(build_model, "dense", checkpointing=True),
        functools.partial(lm_case, attention_cp_style="kv_ring", expect_attention="kv_ring"),
        SUBSET,
    ),
    # ... and chosen by "auto" where it cannot: 2 query heads, 1 KV head, fewer than cp = 4 (cp = 2 keeps Ulysses).
    "moe_two_heads_auto": (
        functools.partial(build_model, "moe", num_attention_heads=2, head_dim=16),
        functools.partial(lm_case, expect_attention={2: "ulysses", 4: "kv_gather"}),
        SUBSET,
    ),
    # The other order: CP attributes first, then checkpointing.
    "dense_checkpoint_after_cp": (
        functools.partial(build_model, "dense"),
        functools.partial(lm_case, checkpoint_after=True),
        ("mixed_random",),
    ),
}

# fp32 tolerances, relative to each tensor's largest entry. 1e-5 for the output and for every parameter whose
# gradient reaches it without passing back through a Gated DeltaNet layer (observed: <= ~8e-6). Parameters behind a
# GDN layer (the embeddings, every layer below the last GDN layer, and that layer's input norm and GDN weights) get
# 1e-4: the GDN backward in fp32 (chunked delta rule: triangular solve, decay products, reductions over every token
# for A_log and dt_bias) rounds differently for a 16- or 24-token shard than for the whole row, and that rounding
# reaches everything below it; observed up to ~3.6e-5 (A_log, dt_bias, in_proj_qkv, and down to the embeddings).
# The fp64 test below runs every one of these cases and agrees to ~1e-13 (bound 1e-10), which proves the fp32
# differences are rounding, not a CP error.
FP32_RTOL = 1e-5
FP32_BEHIND_GDN_RTOL = 1e-4
FP64_RTOL = 1e-10


def params_behind_gdn(model: Qwen35ForCausalLM) -> set[str]:
    """Report names (``grad.param.*``, without checkpoint wrappers) of the parameters whose gradient flows back
    through a GDN layer."""
    gdn_layers = [i for i, kind in enumerate(model.config.layer_types) if kind == "linear_attention"]
    last_gdn = max(gdn_layers, default=-1)
    behind = set()
    for name, _ in model.named_parameters():
        match = re.search(r"layers\.(\d+)\.", name)
        if match is None:
            below = name.startswith("model.embed_tokens.") and last_gdn >= 0
        else:
            layer = int(match.group(1))
            below = layer < last_gdn or (layer == last_gdn and re.search(r"\.(input_layernorm|linear_attn)\.", name))
        if below:
            behind.add(plain_name(f"grad.param.{name}"))
    return behind


def run_variant(workers: GlooWorkers, variant: str, dtype: torch.dtype) -> None:
    cp = workers.world_size
    factory, case, wanted = VARIANTS[variant]
    if dtype == torch.float64:
        # fp64 model with its fp32 casts (norms, GDN decay, router, as transformers does) turned into no-ops, and
        # logits as the output (token_log_probs are fp32 by design).
        factory = functools.partial(factory, dtype=torch.float64, keep_float64=True)
        case = functools.partial(case, output="logits")
    reference = factory()
    behind = params_behind_gdn(reference)
    expected_names = {"out", *(plain_name(f"grad.param.{n}") for n, _ in reference.named_parameters())}
    rtol = FP64_RTOL if dtype == torch.float64 else FP32_RTOL
    layouts = layout_cases(TOTAL[cp], cp)
    names = list(layouts) if wanted is None else list(wanted)
    precision = "fp64" if dtype == torch.float64 else "fp32"
    failures = []
    for index, layout in enumerate(names):
        seed = 1000 + 100 * cp + index
        report = check_cp_parity(
            workers,
            case,
            seq_lens=layouts[layout],
            inputs=make_inputs(TOTAL[cp], seed),
            seq_dims=SEQ_DIMS,
            module_factory=factory,
            seed=seed,
        )
        # The output and every parameter's gradient are compared (the integer inputs have none).
        got_names = {plain_name(n) for n in report.relative}
        assert got_names == expected_names, sorted(got_names ^ expected_names)
        behind_here = {n for n in report.relative if plain_name(n) in behind}
        rtols = {} if dtype == torch.float64 else dict.fromkeys(behind_here, FP32_BEHIND_GDN_RTOL)
        _record(f"{variant} {precision}", report.relative, behind_here)
        try:
            report.assert_close(rtol=rtol, rtols=rtols)
        except AssertionError as exc:
            failures.append(f"{layout} {layouts[layout]}: {exc}")
    assert not failures, f"cp={cp} {variant} {precision}:\n" + "\n".join(failures)


@with_workers
@pytest.mark.parametrize("variant", VARIANTS)
def test_qwen35_cp_parity_fp32(workers, variant):
    run_variant(workers, variant, torch.float32)


@with_workers
@pytest.mark.parametrize("variant", VARIANTS)
def test_qwen35_cp_parity_fp64_is_exact(workers, variant):
    """The same cases in fp64: CP reorders only roundings, so it agrees to ~1e-13 (bound 1e-10)."""
    run_variant(workers, variant, torch.float64)


def _gdn_without_cp_case(module, metadata, topology, *, input_ids, labels):
    """Deliberately wrong CP: GDN layers left unsharded (no conv halo, no state passing; each shard restarts)."""
    set_context_parallel_attributes(module, topology)
    for layer in module.modules():
        if isinstance(layer, Qwen35GatedDeltaNet):
            layer.cp_topology = CPTopology.single()
    return module(input_ids, metadata.seq_lens, labels=labels).token_log_probs


@with_workers
def test_parity_detects_gdn_without_cp(workers):
    """The weights are strong enough that the recurrent state crossing a shard cut matters: dropping the GDN layers'
    CP breaks parity far beyond the tolerances; with the row tiled by shard-sized documents nothing crosses, and
    it holds. (Attention cannot be dropped this way: Ulysses rejects metadata built for another topology.)"""
    case = _gdn_without_cp_case  # module level, so that the workers import it by name
    cp = workers.world_size
    total = TOTAL[cp]
    factory = functools.partial(build_model, "dense")
    inputs = make_inputs(total, seed=3)
    for seq_lens in ([total], layout_cases(total, cp)["spans_all_ranks"]):
        report = check_cp_parity(
            workers, case, seq_lens=seq_lens, inputs=inputs, seq_dims=SEQ_DIMS, module_factory=factory
        )
        assert report.relative["out"] > 1e-2, (seq_lens, report.relative["out"])
    report = check_cp_parity(
        workers, case, seq_lens=[total // cp] * cp, inputs=inputs, seq_dims=SEQ_DIMS, module_factory=factory
    )
    report.assert_close(rtol=FP32_RTOL, rtols=dict.fromkeys(params_behind_gdn(factory()), FP32_BEHIND_GDN_RTOL))


def test_checkpointing_leaves_the_model_unchanged():
    """Unsharded: the checkpoint-wrapped model gives the plain model's outputs and gradients (same seed, same
    weights), so the checkpointed parity above compares the same function."""
    inputs = make_inputs(32, seed=7)
    results = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = build_model("dense", checkpointing=checkpointing)
        set_context_parallel_attributes(model, CPTopology.single())
        out = model(inputs["input_ids"], [10, 22], labels=inputs["labels"]).token_log_probs
        out.sum().backward()
        grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in model.named_parameters()}
        results.append((out.detach(), grads))
    (out0, grads0), (out1, grads1) = results
    assert torch.equal(out0, out1)
    assert grads0.keys() == grads1.keys()
    for name, grad in grads0.items():
        assert torch.equal(grad, grads1[name]), name


# --------------------------------------------------------------------------------------------------------
# Setup validation: every rank raises the same ContextParallelError, none is left in a collective


def _set_cp(topology: CPTopology, config_name: str, overrides: dict, attention_cp_style: str | None = None) -> str:
    """set_context_parallel_attributes on a model with these overrides (and the attention style, None: the
    default); on error, prove nothing was half-set. Returns the attention layers' strategy."""
    model = build_model(config_name, **overrides)
    style = {} if attention_cp_style is None else {"attention_cp_style": attention_cp_style}
    try:
        set_context_parallel_attributes(model, topology, **style)
    except Exception:
        layers = [m for m in model.modules() if isinstance(m, ContextParallelModule)]
        assert layers and all(m.cp_topology.size == 1 for m in layers), "layers configured before the error"
        raise
    (style,) = {m.attention_cp_style for m in model.modules() if isinstance(m, ContextParallelAttention)}
    return style


def test_set_context_parallel_attributes_takes_a_topology():
    """A process group (or None) where the topology belongs gets one line naming the CPTopology to build, and
    nothing is set."""
    model = build_model("dense")
    with pytest.raises(ContextParallelError, match=r"takes a cp_core.CPTopology, got NoneType: build one with"):
        set_context_parallel_attributes(model, None)
    assert all(m.cp_topology == CPTopology.single() for m in model.modules() if isinstance(m, ContextParallelModule))


def _set_cp_on_transformers_model(topology: CPTopology) -> str:
    import transformers

    model = transformers.Qwen3_5ForCausalLM(make_config("dense"))
    set_context_parallel_attributes(model, topology)
    return "ok"


def _forward_with_seq_lens(
    topology: CPTopology, local_len: int, seq_lens: list[int] | dict[int, list[int]]
) -> tuple[int, ...]:
    """A forward of this rank's ``local_len`` tokens with ``seq_lens`` (a dict: per rank, [3, rest] for the others)."""
    if isinstance(seq_lens, dict):
        seq_lens = seq_lens.get(topology.rank, [3, topology.size * local_len - 3])
    torch.manual_seed(0)
    model = build_model("dense")
    set_context_parallel_attributes(model, topology)
    input_ids = torch.randint(0, VOCAB, (local_len,))
    out = model(input_ids, seq_lens, labels=input_ids)
    return tuple(out.token_log_probs.shape)


@with_workers
def test_heads_that_do_not_split_over_cp_are_rejected(workers):
    cp = workers.world_size
    # 6 query heads, 3 KV heads: cp=4 does not divide the query heads; cp=2 does, but 2 and 3 KV heads do not nest.
    overrides = {"num_attention_heads": 6, "num_key_value_heads": 3}
    must_name = ["q_heads=6", "cp=4"] if cp == 4 else ["kv_heads=3", "cp=2"]
    for style in (None, "ulysses"):  # Ulysses is the default
        assert_every_rank_raises(workers, _set_cp, "dense", overrides, style, must_name=[*must_name, "kv_gather"])
    # All-gathered KV takes them, forced or picked by "auto"; the default heads (4 query, 2 KV) split over both sizes.
    for style in ("auto", "kv_gather"):
        assert workers.run(_set_cp, "dense", overrides, style, timeout_s=60) == ["kv_gather"] * cp
    assert workers.run(_set_cp, "dense", {}, timeout_s=60) == ["ulysses"] * cp
    assert workers.run(_set_cp, "dense", {}, "auto", timeout_s=60) == ["ulysses"] * cp
    assert_every_rank_raises(
        workers, _set_cp, "dense", {}, "ring", must_name=["unknown attention CP style 'ring'"]
    )  # fmt: skip


@with_workers
def test_transformers_model_is_rejected(workers):
    assert_every_rank_raises(
        workers, _set_cp_on_transformers_model, must_name=["Qwen3_5ForCausalLM", "no context-parallel layers"]
    )


@with_workers
def test_bad_row_lengths_are_rejected(workers):
    cp = workers.world_size
    local = 8
    # The row (sum of seq_lens) is not divisible by cp.
    assert_every_rank_raises(
        workers, _forward_with_seq_lens, local, [5, cp * local - 4], must_name=[f"not divisible by cp={cp}"]
    )
    # Divisible, but not this shard's row: seq_lens for 2x the tokens the ranks hold.
    assert_every_rank_raises(
        workers,
        _forward_with_seq_lens,
        local,
        [3, 2 * cp * local - 3],
        must_name=[f"seq_lens sum to {2 * cp * local}", f"holds {local}"],
    )
    # Every rank's row is valid, but the last rank was given another one: every rank raises, before any exchange
    # could leave one waiting.
    assert_every_rank_raises(
        workers, _forward_with_seq_lens, local, {cp - 1: [cp * local]}, must_name=[f"rank(s) [{cp - 1}] got other"]
    )
    # The odd row also fails the last rank's own checks (its sum): that rank says why, the others name it.
    results = workers.run_collect(_forward_with_seq_lens, local, {cp - 1: [cp * local + 1]}, timeout_s=60)
    assert f"not divisible by cp={cp}" in results[-1].message
    assert all(f"CP rank(s) [{cp - 1}] rejected their inputs" in r.message for r in results[:-1]), results
    # The control: the matching seq_lens run.
    assert workers.run(_forward_with_seq_lens, local, [3, cp * local - 3], timeout_s=120) == [(local,)] * cp


def _forward_with_bad_input(topology: CPTopology, bad_ranks: tuple[int, ...], what: str) -> int:
    """A cp forward and backward where ranks ``bad_ranks`` pass one malformed input of kind ``what``."""
    torch.manual_seed(0)
    local = 8
    model = build_model("dense")
    set_context_parallel_attributes(model, topology, attention_cp_style="kv_gather")
    ids = torch.randint(0, VOCAB, (local,))
    kwargs = {"labels": ids.clone()}
    if topology.rank in bad_ranks:
        kwargs.update(bad_row_input(what, model, ids))
        ids = kwargs.pop("input_ids", ids)
    out = model(ids, [5, topology.size * local - 5], **kwargs)
    out.token_log_probs.sum().backward()
    return local


def bad_row_input(what: str, model: torch.nn.Module, ids: torch.Tensor) -> dict:
    """One malformed forward argument of kind ``what`` for a rank holding ``ids``, and the error it must raise."""
    local, vocab = ids.numel(), model.config.vocab_size
    if what == "position_ids":
        return {"position_ids": torch.arange(local + 1)}
    if what == "labels":
        return {"labels": torch.randint(0, vocab, (local + 1,))}
    if what == "label_value":  # one past the vocabulary, in this rank's shard only
        return {"labels": torch.cat([ids[:-1], torch.tensor([vocab])])}
    if what == "embeds_batch":
        embeds = model.model.embed_tokens(ids).detach()
        return {"input_ids": None, "inputs_embeds": torch.stack([embeds, embeds])}
    if what == "ids_value":  # a token past the vocabulary: an index error (a device assert on CUDA) on this rank
        return {"input_ids": torch.cat([ids[:-1], torch.tensor([vocab + 5])])}
    if what == "ids_dtype":
        return {"input_ids": ids.float()}
    assert what == "ids_type", what
    return {"input_ids": ids.tolist()}


BAD_ROW_INPUTS = {  # kind -> what the rank given it says
    "position_ids": "position_ids (9,) must be [T], [1, T] or [3, T] with this rank's T = 8",
    "labels": "labels (9,) must have this rank's 8 tokens",
    "label_value": f"label {VOCAB} is outside the vocabulary of {VOCAB}",
    "embeds_batch": "inputs_embeds has batch size 2",
    "ids_type": "'list' object has no attribute",
    "ids_value": f"input_ids holds token {VOCAB + 5}, outside the vocabulary [0, {VOCAB})",
    "ids_dtype": "input_ids must hold integer token ids, got dtype torch.float32",
}


@with_workers
def test_one_rank_with_a_bad_input_stops_every_rank(workers):
    """A malformed input on one rank only (its position_ids, labels, a label past the vocabulary, a batch of two
    embeddings, a list for input_ids): that rank raises its own error and every other rank one naming it, at once,
    instead of waiting for it in the next collective; the group stays in step."""
    cp = workers.world_size
    for failing, what in (((cp - 1,), "position_ids"), ((0,), "labels"), ((cp - 1,), "label_value"),
                          ((1,), "embeds_batch"), ((0, cp - 1), "ids_type"), ((cp - 1,), "ids_value"),
                          ((0,), "ids_dtype")):  # fmt: skip
        workers.assert_failing_ranks_stop_every_rank(
            _forward_with_bad_input, failing, what, failing=failing, says=BAD_ROW_INPUTS[what]
        )
    assert workers.run(_forward_with_bad_input, (), "none", timeout_s=120) == [8] * cp
