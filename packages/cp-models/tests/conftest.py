"""Fixtures of the CP test modules: one gloo pool per CP size for a whole module, one torch thread beside it."""

from __future__ import annotations

import pytest

from cp_core.testing import GlooWorkers, one_torch_thread


@pytest.fixture(scope="module")
def one_thread():
    """The gloo workers share the 2 cores with this process; OpenMP spinning in here would starve them."""
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def workers(request):
    """One pool per CP size for the whole module (tests pick the size by indirect parametrization, see
    :data:`cp_cases.with_workers`)."""
    with GlooWorkers(request.param, timeout_s=180, collective_timeout_s=60) as pool:
        yield pool
