"""Parallelism helpers on a plain model: torch.compile of the collective-free parts gives the eager numbers and
one graph shared by all blocks; LoRA adapters merge from a gathered state dict exactly as from the modules."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from cp_core.testing import relative_l2
from cp_models import Qwen35ForCausalLM, apply_activation_checkpointing
from cp_models.qwen3_5 import Qwen35MLP
from sft_trainer.config import tiny_qwen35_config
from sft_trainer.lora import LoRALinear, apply_lora, split_lora_state
from sft_trainer.parallelize import apply_compile


def _model(seed: int = 0) -> Qwen35ForCausalLM:
    torch.manual_seed(seed)
    config = tiny_qwen35_config(vocab_size=97)
    config.num_hidden_layers = 4
    return Qwen35ForCausalLM(config)


def _loss_and_grads(model, ids, lens):
    labels = torch.roll(ids, -1)
    out = model(ids, lens, labels=labels)
    loss = -out.token_log_probs.sum() / ids.numel()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_compile_matches_eager_and_shares_graphs():
    eager = _model()
    compiled = _model()
    apply_activation_checkpointing(compiled)  # compile must look through the wrapper
    torch._dynamo.reset()
    counters.clear()
    count = apply_compile(compiled)
    # per block: input and post-attention norms, the MLP, and the GDN output norm on the 3 GDN blocks
    assert count == 4 * 3 + 3
    assert isinstance(compiled.model.layers[0]._checkpoint_wrapped_module.mlp, Qwen35MLP)
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(1))
    lens = [17, 3, 20]
    ref_loss, ref_grads = _loss_and_grads(eager, ids, lens)
    loss, grads = _loss_and_grads(compiled, ids, lens)
    assert torch.allclose(loss, ref_loss, rtol=1e-5), (loss, ref_loss)
    names = {n.replace("_checkpoint_wrapped_module.", ""): g for n, g in grads.items()}
    for name, ref in ref_grads.items():
        err = relative_l2(names[name], ref, floor=1e-12)
        assert err < 1e-4, (name, err)
    # Blocks of one class share their compiled graphs instead of recompiling per instance (which would hit
    # dynamo's recompile limit and silently fall back to eager on deep models).
    assert counters["stats"]["unique_graphs"] <= 8, dict(counters["stats"])


def test_lora_state_split_merges_like_the_modules():
    model = _model(3)
    apply_lora(model, ["q_proj", "in_proj_qkv", "down_proj"], rank=4, alpha=8.0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoRALinear):
                module.lora_B.normal_()
    state = model.state_dict()
    merged, adapters = split_lora_state(state, 8.0 / 4, merge=True)
    base, adapters_again = split_lora_state(state, 8.0 / 4, merge=False)
    assert adapters.keys() == adapters_again.keys() and len(adapters) == 2 * (1 + 3 + 4)
    assert not any(".base." in n or "lora_" in n for n in merged)
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            assert torch.allclose(merged[f"{name}.weight"], module.merged().weight, atol=1e-6)
            assert torch.equal(base[f"{name}.weight"], module.base.weight)
    plain = _model(3)
    assert merged.keys() == plain.state_dict().keys()


def _poisoned_steps(_topology, fsdp: bool) -> list[tuple[bool, bool, bool]]:
    """Two train steps at cp = 2 where rank 1's activations are made non-finite in the first one only. Returns,
    per step, (skipped, weights changed on this rank, every gradient cleared)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from cp_core import CPTopology
    from cp_models import set_context_parallel_attributes
    from sft_trainer.parallelize import apply_fsdp
    from sft_trainer.train import train_step

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "cp"))
    topology = CPTopology.from_mesh(mesh, "cp")
    model = _model(5)
    set_context_parallel_attributes(model, topology)
    if fsdp:
        apply_fsdp(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    poison = {"on": dist.get_rank() == 1}
    model.model.norm.register_forward_hook(lambda _m, _i, out: out * float("inf") if poison["on"] else out)
    ids = torch.randint(0, 97, (32,), generator=torch.Generator().manual_seed(2))
    row = {"input_ids": ids, "labels": torch.roll(ids, -1), "seq_lens": [20, 12]}

    def snapshot() -> list[torch.Tensor]:
        return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]

    results = []
    for _ in range(2):
        before = snapshot()
        _, _, _, skipped = train_step(
            model, optimizer, scheduler, [row], topology, None, dist.group.WORLD, 1.0, torch.device("cpu"), fsdp
        )
        changed = any(not torch.equal(a, b) for a, b in zip(before, snapshot(), strict=True))
        results.append((skipped, changed, all(p.grad is None for p in model.parameters())))
        poison["on"] = False
    return results


def test_non_finite_step_is_skipped_on_every_rank():
    """A non-finite loss on one CP rank only skips the step on both ranks (weights untouched, gradients cleared),
    with replicas and with FSDP2; the next clean step trains."""
    from cp_core.testing import GlooWorkers

    with GlooWorkers(world_size=2) as workers:
        for fsdp in (False, True):
            per_rank = workers.run(_poisoned_steps, fsdp)
            for first, second in per_rank:
                assert first == (True, False, True), (fsdp, per_rank)
                assert second == (False, True, True), (fsdp, per_rank)


def test_a_step_without_loss_tokens_has_no_loss_and_is_not_applied():
    """Rows whose labels are all ignored: the loss is None and the weights stay put (AdamW with momentum from an
    earlier step and weight decay would move them on a zero gradient); the schedule still advances."""
    from cp_core import CPTopology
    from sft_trainer.train import train_step

    model = _model(6)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    ids = torch.randint(0, 97, (32,), generator=torch.Generator().manual_seed(3))
    trained = {"input_ids": ids, "labels": torch.roll(ids, -1), "seq_lens": [20, 12]}
    silent = {**trained, "labels": torch.full_like(ids, -100)}
    args = (CPTopology.single(), None, None, 1.0, torch.device("cpu"))
    loss, tokens, _, skipped = train_step(model, optimizer, scheduler, [trained], *args)
    assert loss is not None and loss > 0 and tokens == 32 and not skipped
    before = [p.detach().clone() for p in model.parameters()]
    loss, tokens, grad_norm, skipped = train_step(model, optimizer, scheduler, [silent, silent], *args)
    assert (loss, tokens, grad_norm, skipped) == (None, 0, 0.0, False)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())
    assert scheduler.get_last_lr()[0] == 1e-2 * (1.0 / 3)
