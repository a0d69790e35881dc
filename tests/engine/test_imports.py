"""The engine never imports torch.distributed (issue 2): checked in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

ENGINE = ["workload", "cluster", "plan", "perf", "calibrate", "planner", "restorer", "selector",
          "failures", "rehab", "stragglers", "sim"]


def loaded_torch_modules() -> list[str]:
    code = (
        "import importlib, json, sys\n"
        f"for m in {ENGINE!r}: importlib.import_module('chameleon_ft.' + m)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_engine_does_not_import_torch_distributed():
    loaded = loaded_torch_modules()
    assert not [m for m in loaded if m == "torch.distributed" or m.startswith("torch.distributed.")], loaded


def test_engine_is_pure_python_numpy_scipy_networkx():
    assert loaded_torch_modules() == []
