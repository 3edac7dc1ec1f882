"""Qwen3.5-VL under context parallelism on real gloo groups of 2 and 4 ranks.

Every rank gets the whole packed row (ids, labels, images); the model shards it at the root. Compared with one
unsharded run: the logits and per-token log-probs of every shard, and every parameter gradient summed over the
ranks, vision tower included, for both vision modes ("shard": each rank encodes a balanced subset of the images and
the embeddings are all-gathered; "replicate": every rank encodes every image), with and without activation
checkpointing (applied before the CP topology is set). Rows mix documents with and without images, put images
across shard cuts and across several ranks, hold fewer images than ranks (ranks that encode nothing) or none.
"""

from __future__ import annotations

import pytest
import torch
from vl_cases import VOCAB, build_row, make_config, pad_row, randomize_

from cp_core import CPTopology
from cp_core.testing import GlooWorkers, RankFailure, keep_float64_, relative_max
from cp_models import apply_activation_checkpointing, set_context_parallel_attributes
from cp_vlm import Qwen35VLForConditionalGeneration

TOL = 1e-5

ROWS = {
    # images straddling shard cuts, a text-only document between them
    "mixed": [[3, (1, 4, 6), 2], [6], [1, (1, 2, 2), 4, (1, 4, 4), 3], [2]],
    # one 16-token image spanning several shards (cp = 4: every rank holds part of it), fewer images than ranks
    "one_big_image": [[2, (1, 8, 8), 5], [9]],
    # more images than ranks, of different sizes (the balancer splits them unevenly)
    "many_images": [[(1, 2, 2), 1, (1, 4, 2), (1, 2, 6)], [1, (1, 6, 4), (1, 2, 2), 2], [(1, 4, 4)]],
    "text_only": [[11], [3, 7], [1]],
}


def build_model(config_kwargs: dict, state: dict, vision_cp: str, checkpointing: bool, dtype: torch.dtype):
    # sdpa: transformers' eager vision attention takes its softmax in fp32, which would cap the fp64 runs.
    model = Qwen35VLForConditionalGeneration(make_config(**config_kwargs), vision_cp=vision_cp, vision_attention="sdpa")
    model.load_state_dict(state)
    model.to(dtype)
    blocks = [*model.decoder_layers(), *model.vision_blocks()]
    if checkpointing:
        apply_activation_checkpointing(model)
        apply_activation_checkpointing(model, model.vision_blocks())
    if dtype == torch.float64:
        keep_float64_(model, blocks)  # the unwrapped blocks: their recomputation in backward is covered too
    return model


def run_rank(
    topology: CPTopology,
    config_kwargs,
    state,
    row,
    vision_cp,
    checkpointing,
    seed,
    dtype=torch.float32,
    attention_cp_style="ulysses",
):
    model = build_model(config_kwargs, state, vision_cp, checkpointing, dtype)
    row = dict(row, pixel_values=None if row["pixel_values"] is None else row["pixel_values"].to(dtype))
    set_context_parallel_attributes(model, topology, attention_cp_style=attention_cp_style)
    ids = row["input_ids"]
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, VOCAB, ids.shape, generator=gen)
    labels[::5] = -100
    logit_weights = torch.randn(ids.numel(), VOCAB, generator=gen).to(dtype)
    logp_weights = torch.randn(ids.numel(), generator=gen).to(dtype)
    start, end = topology.shard_range(ids.numel())
    out = model(
        ids,
        row["seq_lens"],
        pixel_values=row["pixel_values"],
        image_grid_thw=row["image_grid_thw"],
        labels=labels,
        return_logits=True,
    )
    loss = (out.logits * logit_weights[start:end]).sum() + (out.token_log_probs * logp_weights[start:end]).sum()
    loss.backward()
    grads = {
        n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters() if p.grad is not None
    }
    names = [n.replace("_checkpoint_wrapped_module.", "") for n, _ in model.named_parameters()]
    return {"logits": out.logits.detach(), "logp": out.token_log_probs.detach(), "grads": grads, "names": names}


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def workers(request):
    with GlooWorkers(request.param) as pool:
        yield pool


@pytest.fixture(scope="module")
def weights():
    out = {}
    for moe in (False, True):
        torch.manual_seed(0)
        model = randomize_(Qwen35VLForConditionalGeneration(make_config(moe)), seed=int(moe))
        out[moe] = model.state_dict()
    return out


def compare(results: list[dict], reference: dict) -> dict[str, float]:
    errors = {
        "logits": relative_max(torch.cat([r["logits"] for r in results]), reference["logits"]),
        "logp": relative_max(torch.cat([r["logp"] for r in results]), reference["logp"]),
    }
    for name in reference["names"]:
        ref = reference["grads"].get(name)
        got = [r["grads"].get(name) for r in results]
        # Every rank has every gradient (vision included, zero on a rank that encoded nothing): FSDP needs that.
        assert all(g is not None for g in got), (name, [g is None for g in got])
        assert ref is not None, name
        errors[f"grad.{name}"] = relative_max(torch.stack(got).sum(0), ref)
    return errors


# fp64 (the model's fp32 upcasts made no-ops): CP is exact up to the few pieces that stay fp32 inside (the loss's
# log-softmax, which bounds the LM head's gradient at ~2e-8; transformers 5.17's vision rotary tables, ~1e-7);
# measured with transformers 5.24: vision gradients 1e-13, everything else <= 1.6e-8; with 5.17: <= 1.1e-7. fp32:
# outputs within 1e-5; gradients within 5e-4, because a gradient summed over ranks from partial gradients much
# larger than the sum amplifies fp32 rounding (measured up to 1.1e-4 on vision LayerNorm biases at cp = 4, where
# the same cases in fp64 agree to 1e-13; the unsharded fp32 run itself is 1.2e-5 away from fp64).
TOLERANCES = {torch.float64: (1e-6, 1e-6), torch.float32: (1e-5, 5e-4)}


@pytest.mark.parametrize(
    "dtype,checkpointing",
    [(torch.float64, False), (torch.float64, True), (torch.float32, False)],
    ids=["fp64", "fp64_act_ckpt", "fp32"],
)
@pytest.mark.parametrize("vision_cp", ["shard", "replicate"])
@pytest.mark.parametrize("row_name", list(ROWS))
def test_cp_matches_unsharded(workers, weights, row_name, vision_cp, dtype, checkpointing):
    cp = workers.world_size
    moe = row_name == "many_images"  # MoE text model on one row, dense on the others
    row = pad_row(build_row(ROWS[row_name], seed=len(row_name)), 4)
    if row_name == "one_big_image" and cp == 4:  # the image's 16 tokens cover one whole shard and parts of two
        ids, local = row["input_ids"].tolist(), row["input_ids"].numel() // 4
        start = ids.index(90)
        assert start // local == 0 and (start + 15) // local == 2
    args = (
        {"moe": moe},
        weights[moe],
        {k: v for k, v in row.items() if k != "docs"},
        vision_cp,
        checkpointing,
        1,
        dtype,
    )
    reference = run_rank(CPTopology.single(), *args)
    results = workers.run(run_rank, *args)
    errors = compare(results, reference)
    out_tol, grad_tol = TOLERANCES[dtype]
    bad = {n: e for n, e in errors.items() if not e <= (grad_tol if n.startswith("grad.") else out_tol)}
    assert not bad, bad
    vision = [n for n in errors if "visual" in n]
    assert vision  # the vision tower's gradients were compared
    if row["image_grid_thw"] is None:
        for r in results:  # text-only row: zero vision gradients everywhere, and no image was encoded
            assert all(torch.count_nonzero(r["grads"][n.removeprefix("grad.")]) == 0 for n in vision)


def test_kv_gather_and_ring_attention_match_unsharded(workers, weights):
    """Text attention by all-gathered keys and values and by keys and values passed around the ring (MRoPE
    positions, the image spanning three shards at cp 4), fp64: the same outputs and gradients as the unsharded
    model."""
    row = {k: v for k, v in pad_row(build_row(ROWS["one_big_image"], seed=3), 4).items() if k != "docs"}
    args = ({"moe": False}, weights[False], row, "shard", False, 1, torch.float64)
    reference = run_rank(CPTopology.single(), *args)
    for style in ("kv_gather", "kv_ring"):
        errors = compare(workers.run(run_rank, *args, style), reference)
        out_tol, grad_tol = TOLERANCES[torch.float64]
        bad = {n: e for n, e in errors.items() if not e <= (grad_tol if n.startswith("grad.") else out_tol)}
        assert not bad, (style, bad)
        assert any("self_attn" in n for n in errors)


def test_shard_and_replicate_agree(workers, weights):
    """The two vision modes give the same outputs and summed gradients, to fp32 rounding: the tower runs its images
    in different batches, and the gradients are summed in a different order (measured: logits 1e-7 on one CPU and
    1.8e-6 on an AMD EPYC, whose BLAS blocks the batched matmuls differently; gradients 2e-6, and up to 1.1e-5 for
    the vision gradients summed over 4 ranks there)."""
    row = {k: v for k, v in pad_row(build_row(ROWS["many_images"], seed=4), 4).items() if k != "docs"}
    runs = {
        mode: workers.run(run_rank, {"moe": True}, weights[True], row, mode, False, 2)
        for mode in ("shard", "replicate")
    }
    for rank, (a, b) in enumerate(zip(runs["shard"], runs["replicate"], strict=True)):
        assert relative_max(a["logits"], b["logits"]) <= 1e-5, rank
        for name, grad in a["grads"].items():  # the text model sees the same shard in both modes
            if "visual" not in name:
                assert relative_max(grad, b["grads"][name]) <= 1e-5, (rank, name)
    # A rank's vision gradient is of its own images (shard) or of its own image tokens (replicate); the sums agree.
    for name in runs["shard"][0]["grads"]:
        total = {mode: torch.stack([r["grads"][name] for r in results]).sum(0) for mode, results in runs.items()}
        assert relative_max(total["shard"], total["replicate"]) <= 5e-5, name


def _indivisible_row(topology: CPTopology, state) -> None:
    model = Qwen35VLForConditionalGeneration(make_config(), vision_attention="eager")
    model.load_state_dict(state)
    set_context_parallel_attributes(model, topology)
    row = build_row([[3, (1, 4, 4), 2]], seed=0)  # 11 tokens
    model(row["input_ids"], row["seq_lens"], pixel_values=row["pixel_values"], image_grid_thw=row["image_grid_thw"])


def test_bad_row_raises_on_every_rank(workers, weights):
    cp = workers.world_size
    results = workers.run_collect(_indivisible_row, weights[False], timeout_s=60)
    for rank, result in enumerate(results):
        assert isinstance(result, RankFailure) and result.type_name == "ContextParallelError", rank
        assert f"packed row length 11 is not divisible by cp={cp}" in result.message


def _other_image_on_last_rank(topology: CPTopology, state) -> None:
    """The same token count and document lengths on every rank, but the last rank's image has another grid."""
    model = Qwen35VLForConditionalGeneration(make_config(), vision_attention="eager")
    model.load_state_dict(state)
    set_context_parallel_attributes(model, topology)
    row = pad_row(build_row([[3, (1, 4, 4), 2]], seed=0), topology.size)
    grid = row["image_grid_thw"].clone()
    if topology.rank == topology.size - 1:
        grid[0, 1:] = torch.tensor([2, 8])  # as many patches, another shape
    model(row["input_ids"], row["seq_lens"], pixel_values=row["pixel_values"], image_grid_thw=grid)


def test_ranks_given_different_rows_raise_on_every_rank(workers, weights):
    """A rank whose row differs from the others' (here only in its image grid) makes every rank raise the same
    error before any collective, instead of leaving some in the vision merge's all-gather."""
    cp = workers.world_size
    results = workers.run_collect(_other_image_on_last_rank, weights[False], timeout_s=60)
    for rank, result in enumerate(results):
        assert isinstance(result, RankFailure) and result.type_name == "ContextParallelError", (rank, result)
        assert f"rank(s) [{cp - 1}] got other document lengths or input shapes than rank 0" in result.message


def _bad_input_on_some_ranks(topology: CPTopology, state, failing: tuple[int, ...], what: str) -> None:
    """A valid image row on every rank, except that ranks ``failing`` pass one malformed ``what``."""
    model = Qwen35VLForConditionalGeneration(make_config(), vision_attention="eager")
    model.load_state_dict(state)
    set_context_parallel_attributes(model, topology)
    row = pad_row(build_row([[3, (1, 4, 4), 2], [5]], seed=0), topology.size)
    ids, pixels, labels = row["input_ids"], row["pixel_values"], row["input_ids"].clone()
    if topology.rank in failing:
        if what == "labels":
            labels = labels[:-1]
        elif what == "label_value":
            labels[0] = model.config.text_config.vocab_size
        else:
            pixels = pixels[:-1]
    out = model(ids, row["seq_lens"], pixel_values=pixels, image_grid_thw=row["image_grid_thw"], labels=labels)
    out.token_log_probs.sum().backward()


def test_one_rank_with_a_bad_input_stops_every_rank(workers, weights):
    """One rank's labels one short, a label past the vocabulary, or a patch row missing: that rank raises its own
    error and the others one naming it, at once, instead of waiting for it in the vision merge or an exchange."""
    cp = workers.world_size
    vocab = make_config().text_config.vocab_size
    for failing, what, says in (
        ((cp - 1,), "labels", "must be the whole row like input_ids"),
        ((0,), "label_value", f"label {vocab} is outside the vocabulary of {vocab}"),
        ((1,), "pixel_values", "needs 16 patch rows"),
    ):
        workers.assert_failing_ranks_stop_every_rank(
            _bad_input_on_some_ranks, weights[False], failing, what, failing=failing, says=says
        )
