"""The package's import graph: no module imports itself back through others, lazy imports included
(DESIGN.md §2's layering; issue 18 §5: `kernels/fold.py` once closed a circle with the Triton modules)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "adahop"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> list[str]:
    if node.level:
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    # `from . import x` names a submodule; `from .m import f` names module m
    return [f"{prefix}.{a.name}" for a in node.names] + [prefix]


def import_graph() -> dict[str, set[str]]:
    """adahop module -> the adahop modules it imports anywhere in its file (top level or inside a
    function): a lazy import still closes a circle, it only hides it until the function runs."""
    files = {(_module_name(p)): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = _resolve(mod, path.name == "__init__.py", node)
            else:
                continue
            # a module's own ancestor packages are initialized before it anyway: no circle
            deps.update(n for n in names if n in files and n != mod and not mod.startswith(n + "."))
        graph[mod] = deps
    return graph


def cycles_through(graph: dict[str, set[str]], prefix: str) -> list[list[str]]:
    """Simple cycles (as module paths) among modules whose names start with ``prefix``."""
    nodes = {m for m in graph if m.startswith(prefix)}
    found, seen = [], set()

    def dfs(start, node, path):
        for nxt in sorted(graph[node] & nodes):
            if nxt == start:
                key = frozenset(path)
                if key not in seen:
                    seen.add(key)
                    found.append(path + [start])
            elif nxt not in path and nxt > start:  # each cycle once, from its smallest module
                dfs(start, nxt, path + [nxt])

    for m in sorted(nodes):
        dfs(m, m, [m])
    return found


def test_the_graph_sees_lazy_imports():
    g = import_graph()
    assert "adahop.kernels._triton_fold" in g["adahop.kernels.fold"]  # `from . import _triton_fold` inside a function
    assert "adahop.kernels.backend" in g["adahop.kernels.fold"]


def test_the_cycle_finder_finds_a_circle():
    g = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}
    assert cycles_through(g, "p.") == [["p.a", "p.b", "p.c", "p.a"]]


def test_no_import_circle_in_the_package():
    assert cycles_through(import_graph(), "adahop") == []


# the ops with a Triton twin, which once closed circles with it (each import costs a fresh interpreter)
KERNEL_MODULES = ["adahop.kernels.fold", "adahop.kernels.mx_matmul", "adahop.kernels.optim_step", "adahop.kernels.quantize_mxfp4"]


@pytest.mark.parametrize("module", KERNEL_MODULES)
def test_each_kernel_module_imports_alone(module):
    """Imported first, in a fresh interpreter: a circle at import time fails here with an
    ImportError (partially initialized module)."""
    r = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True,
                       env={"PYTHONPATH": str(SRC), "PATH": ""}, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
