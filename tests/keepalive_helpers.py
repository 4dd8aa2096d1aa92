"""Kept-alive meshes in tests: a registry of the test's own (ended at its end), the
``monarch-nb`` command line, and a process that starts a kept-alive mesh."""

from __future__ import annotations

import subprocess
import sys
import weakref

import psutil
import pytest

from monarch_nb.protocol import keepalive


@pytest.fixture
def mesh_dir(tmp_path, monkeypatch):
    """A registry of this test's own; whatever it lists is ended at the test's end."""
    d = tmp_path / "meshes"
    monkeypatch.setenv("MONARCH_NB_MESH_DIR", str(d))
    yield d
    for e in keepalive.live_entries() if d.exists() else ():
        cli("kill", e["name"])


def cli(*args) -> subprocess.CompletedProcess:
    """``python -m monarch_nb ARGS`` (``monarch-nb``), its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "monarch_nb", *args], capture_output=True, text=True, timeout=60
    )


def start_controller(script_path, *args, ranks: int = 2) -> tuple[subprocess.Popen, list]:
    """Run ``script_path`` (a Python process that starts a kept-alive mesh and prints
    READY); it and the pids of its mesh's agent and ranks, once READY."""
    p = subprocess.Popen(
        [sys.executable, str(script_path), *map(str, args)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    weakref.finalize(p, p.kill)  # a failed test leaves no controller behind
    for line in p.stdout:  # the ranks' output comes out here too
        if line.strip() == "READY":
            break
    else:
        raise AssertionError(f"the controller ended ({p.wait()}) before its mesh was ready")
    kids = mesh_processes(args[0])
    assert len(kids) == ranks + 1, kids  # the mesh's own agent and its ranks
    return p, kids


def mesh_processes(name: str) -> list[int]:
    """The pids of kept-alive mesh ``name``'s own agent (from its registry entry; the
    fork server's child, or its controller's) and of that agent's ranks."""
    agent = keepalive.read_entry(name)["agent_pid"]
    return [agent, *[c.pid for c in psutil.Process(agent).children()]]
