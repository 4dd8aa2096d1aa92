"""The layering of docs/architecture.md, checked and not only declared: the
import-linter contracts of pyproject.toml hold, the API works in a process where
IPython and ipywidgets cannot be imported, and the worker functions the
notebook names by path resolve on a worker."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import monarch_nb as mnb
from monarch_nb.api import context
from monarch_nb.api.launch import names_gpu_build

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict:
    # the subprocesses (and their workers) import this checkout
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}


@pytest.mark.unit
def test_import_contracts_hold():
    pytest.importorskip("importlinter")
    code = (
        "import sys\n"
        "from importlinter.cli import lint_imports\n"
        "sys.exit(lint_imports(no_cache=True))\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    contracts = (ROOT / "pyproject.toml").read_text().count("[[tool.importlinter.contracts]]")
    assert f"Contracts: {contracts} kept, 0 broken." in out, out


BLOCKED = """
import sys

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("IPython", "ipywidgets"):
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, Blocker())
import monarch_nb as mnb
from monarch_nb.api import launch, mesh, recording, remote


def loaded():
    # worker/current.py is imported (mnb.current_rank); no other worker code is
    return sorted(
        m for m in sys.modules
        if m.split(".")[0] in ("IPython", "ipywidgets")
        or m.startswith(("monarch_nb.ui", "monarch_nb.notebook"))
        or m.startswith("monarch_nb.worker.") and m != "monarch_nb.worker.current"
    )


assert not loaded(), loaded()

m = mnb.local_mesh(dp=1, name="no-widgets")
try:
    x = mnb.remote(lambda: 41)()
    y = mnb.remote(lambda v: v + 1)(x)
    assert y.fetch(rank=0, timeout=60) == 42
    # the ranks' host agent imports torch; the controller needs it only for a GPU build's
    # default backend (~1.3 s of CPU each kernel's first mesh cost)
    if not launch._torch_has_gpu_build():
        assert "torch" not in sys.modules, "the controller imported torch"
    import torch

    t = mnb.remote(torch.ones)(2)
    assert t.reduce("dp", "sum").fetch(rank=0, timeout=60).tolist() == [1.0, 1.0]
    try:
        x.reduce("dp", "median")
    except ValueError as e:
        assert "unknown reduction 'median'" in str(e), e
    else:
        raise AssertionError("an unknown reduction was accepted")
    try:
        m.dashboard()
    except ImportError as e:
        assert "blocked" in str(e), e
    else:
        raise AssertionError("a dashboard was made without ipywidgets")
    assert m.alive
finally:
    m.shutdown()
assert not loaded(), loaded()  # after a remote call, a reduce and mesh.dashboard()
print("OK")
"""


def test_the_api_runs_without_ipython_or_ipywidgets():
    p = subprocess.run(
        [sys.executable, "-c", BLOCKED],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stdout + p.stderr


def test_import_monarch_nb_does_not_import_torch():
    """The package loads in milliseconds (simulated hosts, the CLI); the tensor
    engine, and torch, load on first use."""
    code = "import sys, monarch_nb, monarch_nb.api.recording; print('torch' in sys.modules)"
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True
    )
    assert p.returncode == 0 and p.stdout.strip() == "False", p.stdout + p.stderr


@pytest.mark.unit
def test_a_cpu_build_of_torch_is_told_from_its_version_file():
    cpu = "from typing import Optional\ncuda: Optional[str] = None\nhip: Optional[str] = None\n"
    assert not names_gpu_build(cpu)
    assert names_gpu_build(cpu.replace("cuda: Optional[str] = None", "cuda = '12.6'"))
    assert names_gpu_build(cpu.replace("hip: Optional[str] = None", "hip = '6.2.4'"))
    assert names_gpu_build("__version__ = '2.13.0'\n")  # says neither: torch decides
    assert names_gpu_build("cuda = get_cuda()\nhip = None\n")  # not a literal


@pytest.mark.unit
def test_the_dashboard_hook_is_the_packages_and_says_when_missing():
    class _Mesh:
        pass

    make = context.DASHBOARD.value
    assert make is not None and make.__module__ == "monarch_nb"
    context.DASHBOARD.install(None)
    try:
        with pytest.raises(RuntimeError, match="no dashboard maker.*hook 'dashboard'"):
            context.dashboard(_Mesh())
    finally:
        context.DASHBOARD.install(make)
    assert mnb.DeviceMesh.dashboard.__doc__  # the public method stays


@pytest.mark.unit
def test_remote_and_mesh_share_one_registry():
    from monarch_nb.api import mesh as mesh_mod

    assert mesh_mod.get_mesh is context.get_mesh is mnb.get_mesh
    assert mesh_mod.Stream is context.Stream is mnb.Stream
    assert issubclass(mnb.DeviceMesh, context.BaseMesh)
    with pytest.raises(TypeError, match="mesh= must be a DeviceMesh, got int"):
        mnb.remote(len)([], mesh=3)
    with pytest.raises(KeyError, match="no mesh named 'nope'"):
        mnb.get_mesh("nope")


@pytest.mark.unit
def test_no_module_is_over_400_lines():
    pkg = os.path.join(ROOT, "monarch_nb")
    long = {}
    for base, _, files in os.walk(pkg):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(base, f)
                with open(path, encoding="utf-8") as fh:
                    n = sum(1 for _ in fh)
                if n > 400:
                    long[os.path.relpath(path, ROOT)] = n
    assert not long, f"modules over 400 lines (split them by job): {long}"


def _controller_reaches(source: str, filename: str = "<source>") -> list[int]:
    """The lines of ``source`` that reach a mesh's private controller: an attribute
    ``._controller`` (``mesh._controller``) or the name as a string (``getattr``)."""
    return sorted(
        node.lineno
        for node in ast.walk(ast.parse(source, filename))
        if (isinstance(node, ast.Attribute) and node.attr == "_controller")
        or (isinstance(node, ast.Constant) and node.value == "_controller")
    )


@pytest.mark.unit
def test_the_notebook_and_the_ui_reach_meshes_only_through_the_api():
    """notebook/ and ui/ use a mesh's public members (``mesh.key``, ``mesh.alive``,
    ``mesh.check_usable()``, ``mesh.output_handler``, ...), never its controller."""
    assert _controller_reaches("x = mesh._controller.state\n") == [1]
    assert _controller_reaches("y = 1\nc = getattr(m, '_controller')\n") == [2]
    assert _controller_reaches("mesh.controller_name = mesh.key\n") == []
    found = {}
    for part in ("notebook", "ui"):
        for path in sorted((ROOT / "monarch_nb" / part).rglob("*.py")):
            lines = _controller_reaches(path.read_text(encoding="utf-8"), str(path))
            if lines:
                found[str(path.relative_to(ROOT))] = lines
    assert not found, f"notebook/ and ui/ reach mesh._controller (use the API): {found}"


@pytest.mark.unit
def test_no_import_circle_lazy_imports_included():
    """No module reaches itself through imports, those inside functions included
    (type-only ones are annotations): each layer and each folder reads one way."""
    import grimp

    graph = grimp.build_graph("monarch_nb", cache_dir=None, exclude_type_checking_imports=True)
    circles = [c for c in _cycles(graph) if len(c) > 1]
    assert not circles, (
        f"import circles (break them; a Hook where a lower part calls up): {circles}"
    )


def _cycles(graph) -> list[list[str]]:
    """Tarjan's strongly connected components of the import graph, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.find_modules_directly_imported_by(w)))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    out.append(sorted(comp))
    return out
