"""fla kernel configs written by one process are what a fresh process runs, without autotuning (CUDA + fla).

Each process is a fresh interpreter with fla's on-disk autotune results off (FLA_CACHE_RESULTS=0), so that the only
way the second one can skip timing the candidates is the folder that cp_core.fla_tuning points fla at.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from cp_core.fla_tuning import tuning_folder
from cp_core.recurrent_backends import fla_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and fla_available()), reason="needs CUDA and flash-linear-attention"
    ),
]

_STEP = textwrap.dedent(
    """
    import json, sys
    import torch
    from cp_core.fla_tuning import tuning_folder, use_fla_tuning, write_fla_tuning, _fla_autotuners
    folder = use_fla_tuning(0)
    from cp_core.gated_delta import gated_delta_rule
    torch.manual_seed(0)
    t, hk, hv, d = 512, 16, 16, 128  # the Qwen3.5 linear-attention heads: kernels a warm Triton cache holds
    q, k = (torch.randn(t, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    v = torch.randn(t, hv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = (-torch.rand(t, hv, device="cuda")).requires_grad_()
    beta = torch.rand(t, hv, device="cuda", dtype=torch.bfloat16).requires_grad_()
    o, _ = gated_delta_rule(q, k, v, g, beta, seq_lens=[200, 312], qk_l2norm=True, backend="fla")
    o.float().square().sum().backward()
    torch.cuda.synchronize()
    if sys.argv[1] != "-":
        write_fla_tuning(tuning_folder(sys.argv[1], 0))
    timed = sorted({t.kernel_name for t in _fla_autotuners() if hasattr(t, "bench_time")})
    print(json.dumps({"folder": str(folder), "timed": timed, "out": o.float().sum().item(),
                      "grads": [x.grad.float().norm().item() for x in (q, k, v, g, beta)]}))
    """
)


def _run(env: dict, write_to: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _STEP, write_to], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_written_configs_replace_autotuning_in_a_fresh_process(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLA_", "CP_FLA_"))}
    env["FLA_CACHE_RESULTS"] = "0"
    first = _run({**env, "FLA_CACHE_MODE": "disabled"}, str(tmp_path))
    assert first["timed"], "the first process should have autotuned fla's kernels"
    folder = tuning_folder(tmp_path, 0)  # tmp_path/<GPU name>/fla-<version>
    written = {p.stem for p in folder.glob("*.json")}
    assert set(first["timed"]) <= written

    second = _run({**env, "CP_FLA_TUNING_DIR": str(tmp_path)}, "-")
    assert second["folder"] == str(folder)
    assert second["timed"] == [], f"kernels autotuned despite written configs: {second['timed']}"
    assert second["out"] == pytest.approx(first["out"], rel=1e-3)
    assert second["grads"] == pytest.approx(first["grads"], rel=1e-3)
