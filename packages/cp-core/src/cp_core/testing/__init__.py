"""Parity harness: run code on real multi-process gloo CP groups and compare it with an unsharded run.

This package is public so that users can prove their own CP layers the way this project proves its own:

    from cp_core.testing import GlooWorkers, check_cp_parity, layout_cases

    with GlooWorkers(world_size=2) as workers:          # started once, reused for many cases
        for name, seq_lens in layout_cases(64, cp=2).items():
            report = check_cp_parity(workers, my_case, seq_lens=seq_lens, inputs={"x": x}, seq_dims={"x": 0})
            report.assert_close(rtol=1e-5)

Modules: ``workers`` (the gloo process pool), ``layouts`` (packed layouts that stress CP cuts), ``parity`` (CP vs
unsharded), ``attention_cases`` (attention parity cases), ``numerics`` (relative errors), ``float64`` (true fp64
runs), ``kernel_agreement`` (fast kernels vs reference paths), ``saved_tensors`` (what autograd keeps),
``comm_counter`` (bytes sent per collective), ``fake_group`` (one rank without its peers), ``versions`` (install
checks).
"""

from cp_core.testing.attention_cases import attention_parity_failures, attention_style_difference, kv_attention_case
from cp_core.testing.comm_counter import CollectiveRecord, CommCounter
from cp_core.testing.fake_group import fake_process_group
from cp_core.testing.float64 import KeepFloat64, keep_float64_
from cp_core.testing.kernel_agreement import KernelAgreement, kernel_agreement
from cp_core.testing.layouts import layout_cases, random_seq_lens
from cp_core.testing.numerics import relative_l2, relative_max
from cp_core.testing.parity import ParityCase, ParityReport, check_cp_parity, run_parity_case
from cp_core.testing.saved_tensors import saved_storages
from cp_core.testing.versions import declared_version
from cp_core.testing.workers import GlooWorkers, RankError, RankFailure, one_torch_thread

__all__ = [
    "CollectiveRecord",
    "CommCounter",
    "GlooWorkers",
    "KeepFloat64",
    "KernelAgreement",
    "ParityCase",
    "ParityReport",
    "RankError",
    "RankFailure",
    "attention_parity_failures",
    "attention_style_difference",
    "check_cp_parity",
    "declared_version",
    "fake_process_group",
    "keep_float64_",
    "kernel_agreement",
    "kv_attention_case",
    "layout_cases",
    "one_torch_thread",
    "random_seq_lens",
    "relative_l2",
    "relative_max",
    "run_parity_case",
    "saved_storages",
]
