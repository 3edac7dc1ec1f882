"""cp_core (and its test harness) import with torch alone: no model, config or GPU-kernel package."""

from __future__ import annotations

import json
import subprocess
import sys

FORBIDDEN = ("transformers", "pydantic", "fla", "flash_attn", "triton")


def test_import_pulls_in_no_heavy_dependencies():
    code = (
        "import json, sys\n"
        "import cp_core, cp_core.testing\n"
        f"forbidden = {FORBIDDEN!r}\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in forbidden)\n"
        "print(json.dumps({'loaded': loaded, 'torch': 'torch' in sys.modules, 'all': list(cp_core.__all__)}))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["loaded"] == [], f"importing cp_core loaded {report['loaded']}"
    assert report["torch"] is True  # the check really ran in an interpreter that imported cp_core
    assert "ulysses_attention" in report["all"] and "build_packed_metadata" in report["all"]
