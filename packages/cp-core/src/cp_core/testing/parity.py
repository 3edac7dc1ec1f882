"""One CP case sharded over gloo workers against the same case unsharded: output and every gradient."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cp_core.packing import build_packed_metadata
from cp_core.sharding import shard_sequence
from cp_core.testing.numerics import relative_max
from cp_core.testing.workers import GlooWorkers
from cp_core.topology import CPTopology


@dataclass
class ParityReport:
    """Largest differences between the CP run and the unsharded run, per compared tensor.

    ``relative`` is ``max |cp - ref| / max |ref|`` (the error relative to the tensor's scale).
    """

    absolute: dict[str, float] = field(default_factory=dict)
    relative: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, got: torch.Tensor, expected: torch.Tensor) -> None:
        if got.shape != expected.shape:
            raise AssertionError(f"{name}: CP shape {tuple(got.shape)} != reference shape {tuple(expected.shape)}")
        self.absolute[name] = (got.double() - expected.double()).abs().max().item() if got.numel() else 0.0
        self.relative[name] = relative_max(got, expected)

    @property
    def worst(self) -> tuple[str, float]:
        name = max(self.relative, key=self.relative.__getitem__)
        return name, self.relative[name]

    def assert_close(self, rtol: float = 1e-5, rtols: Mapping[str, float] | None = None) -> None:
        """Raise listing every tensor whose relative difference exceeds its tolerance."""
        rtols = rtols or {}
        bad = {
            name: (rel, rtols.get(name, rtol))
            for name, rel in self.relative.items()
            if not rel <= rtols.get(name, rtol)  # NaN fails too
        }
        if bad:
            lines = [f"{n}: relative {r:.3e} > {tol:.1e} (abs {self.absolute[n]:.3e})" for n, (r, tol) in bad.items()]
            raise AssertionError("CP differs from the unsharded run:\n" + "\n".join(lines))

    def __str__(self) -> str:
        return "\n".join(f"{n}: rel {self.relative[n]:.2e} abs {self.absolute[n]:.2e}" for n in self.relative)


ParityCase = Callable[..., torch.Tensor]


def run_parity_case(
    topology: CPTopology,
    case: ParityCase,
    seq_lens: Sequence[int],
    inputs: Mapping[str, torch.Tensor],
    seq_dims: Mapping[str, int | None],
    module_factory: Callable[[], torch.nn.Module] | None,
    out_seq_dim: int,
    seed: int,
) -> dict[str, Any]:
    """One rank's share of a parity check (also the unsharded reference when ``topology.size == 1``).

    Shards the sequence inputs, runs ``case(module, metadata, topology, **local_inputs)``, back-propagates a
    fixed random output gradient (the same full tensor on every rank, sharded), and returns the local output
    and the gradients of the local inputs and of the module's parameters.
    """
    metadata = build_packed_metadata(seq_lens, topology.rank, topology.size)
    module = None
    if module_factory is not None:
        torch.manual_seed(seed)
        module = module_factory()
    local: dict[str, torch.Tensor] = {}
    for name, tensor in inputs.items():
        dim = seq_dims.get(name)
        piece = tensor if dim is None else shard_sequence(tensor, topology, dim)
        piece = piece.detach().clone()
        local[name] = piece.requires_grad_(piece.is_floating_point())
    out = case(module, metadata, topology, **local)
    full_shape = list(out.shape)
    full_shape[out_seq_dim] *= topology.size
    generator = torch.Generator().manual_seed(seed + 1)
    grad_out = torch.randn(full_shape, generator=generator, dtype=torch.float64).to(out.dtype)
    grad_out = shard_sequence(grad_out, topology, out_seq_dim).to(out.device)
    out.backward(grad_out)
    grads = {f"grad.{n}": t.grad.detach().cpu() for n, t in local.items() if t.grad is not None}
    params = {}
    if module is not None:
        params = {f"grad.param.{n}": p.grad.detach().cpu() for n, p in module.named_parameters() if p.grad is not None}
    return {"out": out.detach().cpu(), **grads, **params}


def check_cp_parity(
    workers: GlooWorkers,
    case: ParityCase,
    *,
    seq_lens: Sequence[int],
    inputs: Mapping[str, torch.Tensor],
    seq_dims: Mapping[str, int | None],
    module_factory: Callable[[], torch.nn.Module] | None = None,
    out_seq_dim: int = 0,
    seed: int = 0,
) -> ParityReport:
    """Compare ``case`` on ``workers`` (sharded over ``workers.world_size`` ranks) with one unsharded run.

    Compared: the output (shards concatenated), the gradient of every floating-point input (sequence-sharded
    inputs concatenated, replicated ones summed over ranks) and of every module parameter (summed over ranks,
    as a data-parallel-style all-reduce would). ``case`` must be a module-level function.
    """
    reference = run_parity_case(
        CPTopology.single(), case, seq_lens, inputs, seq_dims, module_factory, out_seq_dim, seed
    )
    shards = workers.run(run_parity_case, case, seq_lens, inputs, seq_dims, module_factory, out_seq_dim, seed)
    report = ParityReport()
    for name, expected in reference.items():
        missing = [rank for rank, shard in enumerate(shards) if name not in shard]
        if missing:
            raise AssertionError(f"{name} has a gradient unsharded but not on CP rank(s) {missing}")
        pieces = [shard[name] for shard in shards]
        if name == "out":
            got = torch.cat(pieces, dim=out_seq_dim)
        elif name.startswith("grad.param."):
            got = torch.stack(pieces).sum(0)
        else:
            dim = seq_dims.get(name.removeprefix("grad."))
            got = torch.stack(pieces).sum(0) if dim is None else torch.cat(pieces, dim=dim)
        report.add(name, got, expected)
    extra = set().union(*(shard.keys() for shard in shards)) - reference.keys()
    if extra:
        raise AssertionError(f"CP ranks produced gradients the unsharded run did not: {sorted(extra)}")
    return report
