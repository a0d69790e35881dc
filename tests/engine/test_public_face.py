"""What users import (issue 22): the public face at the top of the package, and the deep paths
of before the tree took its layers, which keep working with a warning that names the new place.
Each check runs in a fresh interpreter, so no earlier import hides a missing alias."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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


MOVED = [
    ("chameleon_ft.selector", "select", "chameleon_ft.engine.selector"),
    ("chameleon_ft.restorer", "migrate", "chameleon_ft.engine.migration"),
    ("chameleon_ft.trace", "TraceSetup", "chameleon_ft.sim.trace"),
    ("chameleon_ft.runtime.policy", "EngineBridge", "chameleon_ft.runtime.engine_bridge"),
    ("chameleon_ft.runtime.state", "save_checkpoint", "chameleon_ft.runtime.codec"),
    ("chameleon_ft.runtime.adapters", "LiveCollectives", "chameleon_ft.runtime.adapter_kit"),
    ("chameleon_ft.runtime.pipeline.context", "PipelineExecutor", "chameleon_ft.runtime.executors.pipeline.executor"),
    ("accelerate_ft.runtime", "StepProtocol", "accelerate_ft.step_protocol"),
]


@pytest.fixture(scope="module")
def moved_checks():
    """Every moved path's check, each in its own fresh interpreter, all started at once (they
    spend their time importing torch: two cores share the work)."""
    procs = {}
    for old, name, new in MOVED:
        code = (f"import importlib\nfrom {old} import {name}\n"
                f"assert {name} is getattr(importlib.import_module({new!r}), {name!r})\n"
                f"import {old} as a, {new} as b\nassert a is b\n")
        procs[old] = subprocess.Popen([sys.executable, "-W", "always", "-c", code], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=ROOT)
    yield procs
    for p in procs.values():
        if p.poll() is None:
            p.kill()
        p.communicate()


@pytest.mark.parametrize("old, name, new", MOVED)
def test_a_moved_module_is_the_new_one_and_warns(moved_checks, old, name, new):
    out, err = moved_checks[old].communicate(timeout=120)
    assert moved_checks[old].returncode == 0, err
    assert "ChameleonFTDeprecationWarning" in err and new in err, err


def test_old_class_names_and_the_removed_worker_module_still_import():
    out = run("from chameleon_ft.runtime.worker import ElasticConfig, ElasticContext, layer_params\n"
              "from chameleon_ft.runtime.executors.dp import DataParallelExecutor\n"
              "from chameleon_ft.runtime.config import ElasticConfig as C\n"
              "assert ElasticContext is DataParallelExecutor and ElasticConfig is C\n"
              "from chameleon_ft.runtime.dp import ElasticContext as E\nassert E is DataParallelExecutor\n")
    assert out.returncode == 0, out.stderr
    assert "ElasticContext is now DataParallelExecutor" in out.stderr, out.stderr


def test_python_m_of_the_old_launcher_path_runs_the_launcher():
    out = subprocess.run([sys.executable, "-m", "chameleon_ft.launch", "--help"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "--nproc-per-node" in out.stdout
    assert "chameleon_ft.cli.launch" in out.stderr  # the warning names the new module
