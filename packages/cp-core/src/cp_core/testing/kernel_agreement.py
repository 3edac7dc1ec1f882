"""Fast kernels vs reference (torch) paths: the same weights, output and every parameter gradient, and both vs fp32."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cp_core.testing.numerics import relative_l2


@dataclass
class KernelAgreement:
    """How far a fast-kernel model is from the same weights on the reference paths, and both from fp32.

    ``output``: fast vs reference output; ``fast_vs_fp32`` / ``reference_vs_fp32``: each low-precision output
    against the fp32 run (the fast path should be no worse than the reference in the same dtype);
    ``grads``: fast vs reference parameter gradient, by name; ``grads_fast_vs_fp32`` /
    ``grads_reference_vs_fp32``: each low-precision gradient against the fp32 run's, by name.
    """

    output: float
    fast_vs_fp32: float
    reference_vs_fp32: float
    grads: dict[str, float]
    grads_fast_vs_fp32: dict[str, float] = field(default_factory=dict)
    grads_reference_vs_fp32: dict[str, float] = field(default_factory=dict)

    def grads_worse_than_reference(self, factor: float = 1.25, slack: float = 1e-2) -> dict[str, tuple[float, float]]:
        """Parameters whose fast gradient is further from fp32 than ``factor`` x the reference's (+ ``slack``):
        name -> (fast vs fp32, reference vs fp32). Empty when the fast path is as good as the reference dtype."""
        return {
            name: (err, self.grads_reference_vs_fp32[name])
            for name, err in self.grads_fast_vs_fp32.items()
            if err > factor * self.grads_reference_vs_fp32[name] + slack
        }

    @property
    def worst_grad(self) -> tuple[str, float]:
        name = max(self.grads, key=self.grads.__getitem__)
        return name, self.grads[name]

    def __str__(self) -> str:
        name, worst = self.worst_grad
        return (
            f"output rel {self.output:.2e}; worst grad {name} rel {worst:.2e}; vs fp32: fast "
            f"{self.fast_vs_fp32:.2e}, reference {self.reference_vs_fp32:.2e}"
        )


def kernel_agreement(
    make_model: Callable[[str], torch.nn.Module],
    forward: Callable[[torch.nn.Module], torch.Tensor],
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> KernelAgreement:
    """Compare a model on its fast kernels with the same weights on the reference (torch) paths.

    ``make_model(backend)`` builds the model for ``backend`` "fast" or "reference" (on the target device, fp32);
    all three runs (fast in ``dtype``, reference in ``dtype``, reference in fp32) share the weights of one fp32
    model. ``forward(model)`` returns the output to compare; the same random output gradient is back-propagated
    through all three.
    """
    started = time.perf_counter()

    def note(what: str) -> None:
        if log is not None:
            log(f"[kernel_agreement] {what} at {time.perf_counter() - started:.1f} s")

    torch.manual_seed(seed)
    fp32 = make_model("reference")
    reference, fast = make_model("reference"), make_model("fast")
    note("models built")
    for model in (reference, fast):
        model.load_state_dict(fp32.state_dict())
        model.to(dtype)
    outputs = {}
    upstream = None
    for name, model in (("fast", fast), ("reference", reference), ("fp32", fp32)):
        out = forward(model).float()
        if upstream is None:
            generator = torch.Generator(device=out.device).manual_seed(seed + 1)
            upstream = torch.randn(out.shape, device=out.device, generator=generator)
        (out * upstream).sum().backward()
        outputs[name] = out.detach()
        note(f"{name} forward + backward done")
    ref_params, fp32_params = dict(reference.named_parameters()), dict(fp32.named_parameters())
    with_grad = [(n, p) for n, p in fast.named_parameters() if p.grad is not None]
    return KernelAgreement(
        output=relative_l2(outputs["fast"], outputs["reference"]),
        fast_vs_fp32=relative_l2(outputs["fast"], outputs["fp32"]),
        reference_vs_fp32=relative_l2(outputs["reference"], outputs["fp32"]),
        grads={n: relative_l2(p.grad, ref_params[n].grad) for n, p in with_grad},
        grads_fast_vs_fp32={n: relative_l2(p.grad, fp32_params[n].grad) for n, p in with_grad},
        grads_reference_vs_fp32={n: relative_l2(ref_params[n].grad, fp32_params[n].grad) for n, p in with_grad},
    )
