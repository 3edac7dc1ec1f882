"""LoRA adapters: only adapters train, the merged layer computes the same function, and a CP run with LoRA works."""

import pytest
import torch
from trainer_runs import _train_runs

from cp_models import Qwen35ForCausalLM
from sft_trainer.config import tiny_qwen35_config
from sft_trainer.lora import LoRALinear, apply_lora, merge_lora


def _model():
    torch.manual_seed(0)
    return Qwen35ForCausalLM(tiny_qwen35_config(vocab_size=128))


def test_only_adapters_train_and_merge_is_exact():
    model = _model()
    count = apply_lora(model, ["q_proj", "in_proj_qkv", "out_proj"], rank=4, alpha=8.0)
    assert count == 1 + 3 + 3  # one attention layer, three GDN layers (in_proj_qkv and out_proj)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A" in n or ".lora_B" in n for n in trainable)
    for module in model.modules():
        if isinstance(module, LoRALinear):
            torch.nn.init.normal_(module.lora_B, std=0.1)  # nonzero update
    ids = torch.randint(0, 128, (40,))
    adapted = model(ids, [25, 15]).logits
    merged = merge_lora(model)(ids, [25, 15]).logits
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert ((adapted - merged).abs().max() / adapted.abs().max()) < 1e-5


def test_unknown_target_is_refused():
    with pytest.raises(ValueError, match="matched no linear layer"):
        apply_lora(_model(), ["nonexistent_proj"], rank=4, alpha=8.0)


LORA = ("--train.lora.enabled", "true", "--train.lora.rank", "4", "--train.lr", "1e-2")


def test_lora_run_cp2_equals_cp1_and_exports(tmp_path):
    from transformers import AutoModelForCausalLM

    runs = [(tmp_path / f"cp{cp}", (*LORA, "--parallel.cp", str(cp))) for cp in (2, 1)]
    losses2, losses1 = ([m["loss"] for m in metrics] for metrics in _train_runs(*runs))
    for a, b in zip(losses1, losses2, strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), (losses1, losses2)
    assert losses2[-1] != losses2[0]  # the adapters did train
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "cp2" / "hf")
    ours = Qwen35ForCausalLM.from_pretrained(tmp_path / "cp2" / "hf")
    ids = torch.randint(0, hf.config.vocab_size, (20,))
    with torch.no_grad():
        assert torch.allclose(hf(ids[None]).logits[0], ours(ids, [20]).logits, rtol=1e-4, atol=1e-5)


def test_adapters_are_drawn_from_the_seed_alone():
    """The same seed gives the same adapters whatever torch's global generator did before and whatever the model's
    dtype (every rank draws the same A, bf16 runs included); another seed gives others; dropout seeds differ per
    rank and per seed."""
    from sft_trainer.lora import dropout_seed

    def adapters(seed: int, dtype: torch.dtype, noise: int) -> dict[str, torch.Tensor]:
        model = _model().to(dtype)
        torch.manual_seed(noise)  # whatever the global generator holds must not matter
        apply_lora(model, ["q_proj", "in_proj_qkv"], rank=4, alpha=8.0, seed=seed)
        return {n: p.detach().float() for n, p in model.named_parameters() if n.endswith("lora_A")}

    first, again, other = adapters(3, torch.float32, 1), adapters(3, torch.float32, 2), adapters(4, torch.float32, 1)
    assert len(first) == 4 and all(torch.equal(first[n], again[n]) for n in first)
    assert not any(torch.equal(first[n], other[n]) for n in first)
    half = adapters(3, torch.bfloat16, 5)
    assert all(torch.equal(half[n], first[n].bfloat16().float()) for n in first)
    seeds = {dropout_seed(seed, rank) for seed in range(3) for rank in range(4)}
    assert len(seeds) == 12 and dropout_seed(1, 2) == dropout_seed(1, 2)


def test_a_merged_export_over_an_adapters_export_removes_the_adapters_file(tmp_path):
    """Exports into one folder: the adapters of an unmerged export must not stay beside merged weights (a loader
    that applies them would apply the update twice)."""
    import torch.distributed as dist

    from sft_trainer.config import load_config
    from sft_trainer.run import export_model

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = _model()
        apply_lora(model, ["q_proj"], rank=4, alpha=8.0)
        folder = tmp_path / "hf"
        for merge, adapters_kept in (("false", True), ("true", False)):
            cfg = load_config(None, [*LORA, "--checkpoint.merge_lora", merge, "--output_dir", str(tmp_path / "out")])
            export_model(cfg, model, folder)
            assert (folder / "lora_adapters.safetensors").is_file() == adapters_kept, merge
    finally:
        dist.destroy_process_group()
