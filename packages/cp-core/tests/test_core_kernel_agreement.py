"""cp_core.testing.kernel_agreement on CPU: a faithful "fast" path passes, a perturbed one is caught."""

import torch

from cp_core.testing import kernel_agreement


class _Toy(torch.nn.Module):
    """Two linears; the "fast" backend optionally adds a bias-like error to the hidden activations."""

    def __init__(self, error: float):
        super().__init__()
        self.first, self.second = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)
        self.error = error

    def forward(self, x):
        hidden = torch.tanh(self.first(x))
        if self.error:
            hidden = hidden + self.error * torch.ones_like(hidden)
        return self.second(hidden)


def _agreement(error: float):
    x = torch.randn(64, 16)
    return kernel_agreement(
        lambda backend: _Toy(error if backend == "fast" else 0.0),
        lambda model: model(x.to(next(model.parameters()).dtype)),
    )


def test_same_math_is_as_faithful_as_the_reference():
    result = _agreement(0.0)
    assert result.output == 0.0 and set(result.grads) == set(result.grads_fast_vs_fp32)
    assert result.reference_vs_fp32 > 0  # bf16 rounding is visible
    assert result.grads_worse_than_reference() == {}


def test_a_perturbed_fast_path_is_flagged_by_name():
    result = _agreement(0.3)
    assert result.output > 1e-1
    worse = result.grads_worse_than_reference()
    assert "second.weight" in worse
    fast, reference = worse["second.weight"]
    assert fast > 1.25 * reference + 1e-2
