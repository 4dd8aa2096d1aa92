"""A pids cgroup, to make forks fail on purpose (the host agents' fork-failure tests)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def pids_cgroup(name: str) -> Path:
    """A new pids cgroup called ``name`` (the test removes it); skips where there is
    no writable pids controller."""
    base = Path("/sys/fs/cgroup/pids")
    if not (base / "cgroup.procs").exists() or not os.access(base, os.W_OK):
        pytest.skip("no writable pids cgroup here to make a fork fail")
    d = base / name
    try:
        d.mkdir()
    except OSError as e:
        pytest.skip(f"cannot create a pids cgroup: {e}")
    return d
