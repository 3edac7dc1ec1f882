"""The CP training loop: one packed row per micro-batch, sharded over the cp ranks of each dp replica.

Gradients: every rank computes the gradient of the *global* loss restricted to its tokens (its shard's summed
token losses divided by the token count all-reduced over dp x cp before backward), so the exact gradient is the
sum over all ranks. Under FSDP2 (sft_trainer.parallelize.apply_fsdp) the summing reduce-scatter over dp x cp does
that in backward; with full replicas the gradients are all-reduced (summed) over dp x cp after backward.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cp_core import CPTopology, shard_sequence


@dataclass
class StepStats:
    step: int
    loss: float | None
    """Mean token loss; None for a step whose rows hold no loss token."""
    tokens: int
    """Loss tokens of the step over all ranks."""
    grad_norm: float
    lr: float
    seconds: float
    skipped: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def lr_lambda(step: int, warmup: int, total: int, decay: str, min_ratio: float) -> float:
    """Multiplier of the peak learning rate at ``step`` (0-based): linear warmup, then cosine/linear/constant."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if decay == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if decay == "cosine" else 1.0 - progress
    return min_ratio + (1 - min_ratio) * shape


def reduce_gradients(params: list[torch.nn.Parameter], group: dist.ProcessGroup | None) -> None:
    """Sum every gradient over ``group`` (replicated parameters; each rank holds a partial gradient)."""
    if group is None or dist.get_world_size(group) == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def global_token_count(labels_rows: list[torch.Tensor], dp_group: dist.ProcessGroup | None, device) -> int:
    """Loss tokens of this step over every micro-batch of every dp replica (rows are whole on every cp rank)."""
    local = sum(int((row >= 0).sum()) for row in labels_rows)  # the rows are host tensors: no device sync
    if dp_group is None or dist.get_world_size(dp_group) == 1:
        return local
    count = torch.tensor([local], dtype=torch.int64, device=device)
    dist.all_reduce(count, group=dp_group)
    return int(count.item())


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    rows: list[dict[str, Any]],
    topology: CPTopology,
    dp_group: dist.ProcessGroup | None,
    world_group: dist.ProcessGroup | None,
    max_grad_norm: float,
    device: torch.device,
    sharded: bool = False,
    whole_rows: bool = False,
) -> tuple[float | None, int, float, bool]:
    """One optimizer step over ``rows`` (the grad-accumulation micro-batches of this dp replica).

    ``sharded``: the model is FSDP2-sharded and its backward already summed the gradients over the world.
    ``whole_rows``: the model takes the whole row and shards it itself (the VL model, which needs the whole row
    for its images and 3-D positions); otherwise each rank feeds its shard of the ids and labels.

    Returns (global mean token loss, global loss tokens, grad norm, skipped). A non-finite loss or gradient on
    any rank skips the step on every rank. A step whose rows hold no loss token has no loss (None) and is not
    applied: its gradient is zero, and AdamW would still move the weights by momentum and weight decay.
    """
    tokens = global_token_count([r["labels"] for r in rows], dp_group, device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    params = [p for p in model.parameters() if p.requires_grad]
    for row in rows:
        if whole_rows:  # host tensors: the model checks the row and builds positions there
            out = model(
                row["input_ids"],
                row["seq_lens"],
                labels=row["labels"],
                pixel_values=row["pixel_values"],
                image_grid_thw=row["image_grid_thw"],
            )
        else:
            ids = shard_sequence(row["input_ids"].to(device), topology, 0)
            labels = shard_sequence(row["labels"].to(device), topology, 0)
            out = model(ids, row["seq_lens"], labels=labels)
        local = -out.token_log_probs.sum()
        (local / max(tokens, 1)).backward()
        loss_sum += local.detach().double()
    if not sharded:
        reduce_gradients(params, world_group)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else float("inf"))
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    if world_group is not None:
        dist.all_reduce(loss_sum, group=world_group)
    finite = (torch.isfinite(loss_sum) & torch.isfinite(grad_norm)).to(torch.float64).reshape(1)
    if world_group is not None:
        dist.all_reduce(finite, op=dist.ReduceOp.MIN, group=world_group)
    # One host sync per step: the loss, the norm and the verdict come back together.
    loss_value, norm_value, finite_value = torch.cat(
        [loss_sum.reshape(1), grad_norm.double().reshape(1), finite]
    ).tolist()
    skipped = finite_value < 1
    if not skipped and tokens > 0:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return (loss_value / tokens if tokens else None), tokens, norm_value, skipped


def _step_of(line: str) -> float:
    """The step of a metrics record (a line that is not one sorts last, so a resume drops it)."""
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return math.inf


class MetricsWriter:
    """JSONL metrics (always) and wandb (when configured) from rank 0."""

    def __init__(self, path: Path | None, wandb_run=None, fresh: bool = True, resumed_at: int = 0):
        self.path, self.wandb_run = path, wandb_run
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            if fresh:  # a new run starts a new file; a resumed one appends
                path.write_text("")
            elif path.exists():  # steps after the checkpoint run again: keep one record per step
                kept = [line for line in path.read_text().splitlines() if _step_of(line) <= resumed_at]
                path.write_text("".join(f"{line}\n" for line in kept))

    def write(self, stats: StepStats) -> None:
        record = {
            "step": stats.step,
            "loss": stats.loss,
            "tokens": stats.tokens,
            "grad_norm": stats.grad_norm,
            "lr": stats.lr,
            "step_time_s": stats.seconds,
            "skipped": stats.skipped,
            **stats.extra,
        }
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(record, step=stats.step)
