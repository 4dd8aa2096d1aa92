"""Kernel tier: restarting or shutting down the kernel leaves no worker process behind."""

from __future__ import annotations

import psutil
import pytest
from kernel_helpers import Kernel, stream, wait_gone

pytestmark = pytest.mark.kernel

ALL_PIDS = (
    "sorted(p for m in mnb.api.mesh.all_meshes().values() "
    "for p in [i['pid'] for i in m.status()['ranks'].values()])"
)


def _start_meshes(k, two: bool = True) -> list[int]:
    k.ok("%load_ext monarch_nb\nimport monarch_nb as mnb")
    k.ok("%monarch_mesh dp=2" if two else "%monarch_mesh dp=1", timeout=120)
    if two:
        k.ok("%monarch_mesh dp=1 --name other", timeout=120)
    k.ok("%%monarch --noblock\nimport time\ntime.sleep(600)")  # busy workers too
    pids = k.value(ALL_PIDS)
    assert len(pids) == (3 if two else 1) and all(psutil.pid_exists(p) for p in pids)
    return pids


def test_kernel_restart_and_shutdown_leave_no_worker(tmp_path):
    k = Kernel(tmp_path)
    try:
        k.ok("%load_ext monarch_nb")
        for line in ("%monarch_mesh", "%%monarch\n1"):  # no mesh yet: a clear usage error
            reply, msgs = k.run(line)
            assert reply["content"]["status"] == "error"
            assert "no active mesh: create one with %monarch_mesh dp=2" in stream(msgs, "stderr")
        first = _start_meshes(k)
        k.km.restart_kernel(now=True)  # the kernel is killed, as "Restart" does when stuck
        assert wait_gone(first) == [], "workers outlived a killed kernel"
        k.kc.wait_for_ready(timeout=60)
        second = _start_meshes(k, two=False)
        assert not set(first) & set(second)
        k.km.restart_kernel(now=False)  # a polite restart: the kernel exits by itself
        assert wait_gone(second) == [], "workers outlived a restarted kernel"
        k.kc.wait_for_ready(timeout=60)
        third = _start_meshes(k, two=False)
    finally:
        k.shutdown()  # shutdown_request: the kernel exits, its atexit stops the meshes
    assert wait_gone(third) == [], "workers outlived a shut down kernel"
