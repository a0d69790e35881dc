"""The tree is the architecture (issue 22): layers import only downwards, modules do not import
each other in a circle, no module outgrows ~600 lines, and the engine stays free of torch.

Read from the source with ``ast`` (every import, also those inside functions), so the checks
cover imports that only run on some paths.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("chameleon_ft", "lightning_ft", "accelerate_ft", "transformers_ft")

# layer -> the layers it may import (its own included).  engine <- sim; engine <- runtime <-
# adapters <- cli; examples are user scripts (the public face and the runtime).
ALLOWED = {
    "engine": {"engine"},
    "sim": {"sim", "engine"},
    "runtime": {"runtime", "engine", "base"},
    "adapters": {"adapters", "runtime", "engine", "base"},
    "examples": {"examples", "runtime", "engine", "base", "top"},
    "cli": {"cli", "sim", "runtime", "engine", "base", "examples", "top"},
    "base": {"base"},
    "top": {"top", "base"},
}


def layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] in ("lightning_ft", "accelerate_ft", "transformers_ft"):
        return "adapters"
    if len(parts) == 1:
        return "top"
    return {"engine": "engine", "sim": "sim", "runtime": "runtime", "cli": "cli",
            "examples": "examples"}[parts[1]]


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            name = ".".join(rel.parts)
            out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def imports(name: str, path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [target + "." + a.name for a in node.names]
            found.update([target] + names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.split(".")[0] in PACKAGES}


def graph() -> nx.DiGraph:
    mods = modules()
    g = nx.DiGraph()
    for name, path in mods.items():
        g.add_node(name)
        for target in imports(name, path):
            while target not in mods and "." in target:  # ``from pkg import name``
                target = target.rpartition(".")[0]
            if target in mods and target != name:
                g.add_edge(name, target)
    return g


def test_layers_import_only_downwards():
    bad = [f"{a} ({layer(a)}) imports {b} ({layer(b)})" for a, b in graph().edges
           if layer(b) not in ALLOWED[layer(a)]]
    assert not bad, "\n".join(bad)


def test_no_import_circle():
    g = graph()
    # A package's __init__ importing its own submodules is how packages export; not a circle.
    g.remove_edges_from([(a, b) for a, b in list(g.edges) if b.startswith(a + ".")])
    cycles = list(nx.simple_cycles(g))
    assert not cycles, cycles[:5]


def test_no_torch_testing_internal_in_package():
    hits = [f"{name}: {t}" for name, path in modules().items()
            for t in _all_imports(path) if t.startswith("torch.testing._internal")]
    assert not hits, hits


def test_private_torch_imports_live_in_one_module():
    """Private torch APIs (a ``_`` segment) are imported in ``runtime/torch_private.py`` only,
    which names the torch versions they were checked on."""
    hits = [f"{name}: {t}" for name, path in modules().items()
            if name != "chameleon_ft.runtime.torch_private"
            for t in _all_imports(path)
            if t.split(".")[0] == "torch" and any(p.startswith("_") for p in t.split(".")[1:])]
    assert not hits, hits


def _all_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def loaded_torch_modules() -> list[str]:
    engine = sorted(n for n in modules() if layer(n) in ("engine", "sim"))
    code = (
        "import importlib, json, sys\n"
        f"for m in {engine!r}: importlib.import_module(m)\n"
        "from chameleon_ft import select, plan_search, homogeneous, transformer, Event\n"
        "print(json.dumps(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_engine_and_sim_are_pure_python_numpy_scipy_networkx():
    assert loaded_torch_modules() == []
