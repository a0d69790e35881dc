"""What users import: the public face at the top of the package.  Each check runs in a fresh
interpreter, so no earlier import hides a missing name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


def test_public_face_exports_what_the_readme_uses():
    out = run(
        "from chameleon_ft import ElasticTrainer, elastic_main, ElasticConfig, ConfigError\n"
        "from chameleon_ft import homogeneous, Event, SearchSpace, plan_search, JobState, SelectorConfig, select, transformer\n"
        "from chameleon_ft.runtime.trainer import ElasticTrainer as T\n"
        "assert ElasticTrainer is T\n"
        "w = transformer(num_layers=8, global_batch=16); c = homogeneous(4)\n"
        "plan = plan_search(w, c, space=SearchSpace(pp_max=2)).best.plan\n"
        "d = select(Event('fail_stop', (1,)), JobState(w, c, plan, frozenset(c.ids)), SelectorConfig(space=SearchSpace(pp_max=2)), mttf_s=3600)\n"
        "print(d.chosen)\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in {"reroute", "replan", "shrink", "wait", "restart"}
    assert "Warning" not in out.stderr, out.stderr  # the public face warns about nothing
