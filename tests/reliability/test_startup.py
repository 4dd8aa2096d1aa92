"""Start-up and restart that fail say so: a torch.distributed that cannot start
fails the mesh's start with the ranks' own error (it used to be logged on the
workers while the mesh looked ready, and the first collective waited), and a
restart whose start-up fails leaves the mesh broken with the reason until the
next restart (it used to look usable with ranks missing). Real workers."""

from __future__ import annotations

import pytest
import torch

import monarch_nb as mnb
from monarch_nb.api.mesh import all_meshes


def test_a_backend_that_cannot_start_fails_the_start_with_the_ranks_error(worker_children):
    before = len(worker_children())
    # this torch has no MPI: init_process_group raises on every rank, as it would on
    # a cluster where one rank's NCCL or network cannot start
    with pytest.raises(mnb.RemoteError) as ei:
        mnb.local_mesh(dp=2, name="no-mpi", backend="mpi")
    e = ei.value
    assert str(e).startswith("mesh 'no-mpi': torch.distributed (mpi) failed to start on ranks 0-1")
    assert sorted(e.failures) == [0, 1] and "MPI" in str(e)
    assert "no-mpi" not in all_meshes()
    from reliability_helpers import wait_for

    wait_for(lambda: len(worker_children()) == before, 15, "the workers of the failed start gone")


def test_a_restart_that_fails_leaves_the_mesh_broken_with_the_reason(monkeypatch, tmp_path):
    # a sitecustomize runs in a fresh interpreter only: workers spawned each, not ranks
    # forked by the host agent (whose failed restart test_host_agent.py makes otherwise)
    monkeypatch.setenv("MONARCH_NB_SPAWN", "popen")
    m = mnb.local_mesh(dp=2, name="restart-fails")
    try:
        # the next workers hang at start-up (before they can join), so the restart
        # times out: no crash marks the mesh broken on its own
        (tmp_path / "sitecustomize.py").write_text("import time\ntime.sleep(120)\n")
        monkeypatch.syspath_prepend(str(tmp_path))  # workers get the controller's path
        monkeypatch.setattr(m._controller, "_startup_timeout", 3.0)
        with pytest.raises(TimeoutError, match="did not join within 3 s"):
            m.restart()
        # broken, saying why, until restarted: never a mesh that looks usable
        with pytest.raises(mnb.RemoteError, match="the restart failed: TimeoutError"):
            mnb.remote(torch.ones)(2, mesh=m).fetch(timeout=30)
        monkeypatch.undo()
        m.restart()
        assert mnb.remote(torch.ones)(2, mesh=m).fetch(timeout=60)[1].tolist() == [1.0, 1.0]
        assert m.status()["ranks"][1]["alive"]
    finally:
        m.shutdown()


def test_shutdown_leaves_the_sockets_to_a_busy_io_thread(caplog):
    import threading

    from reliability_helpers import wait_for

    m = mnb.local_mesh(dp=1, name="busy-io")
    ctrl = m._controller
    entered, release = threading.Event(), threading.Event()

    def stuck_hook(msg):  # an output hook that does not return for a while
        entered.set()
        release.wait(60)

    ctrl.on_output = stuck_hook
    m.exec("print('hello')")
    assert entered.wait(30), "the output never reached the hook"
    ctrl.shutdown(timeout=1.0)  # the IO thread is inside the hook, using nothing else
    assert ctrl.io.thread.is_alive() and not ctrl.io.sockets_closed
    release.set()
    wait_for(lambda: not ctrl.io.thread.is_alive(), 30, "the IO thread to end")
    assert ctrl.io.sockets_closed
    assert "controller IO thread error" not in caplog.text
    m.shutdown()  # unregisters it: a shut-down controller leaves the mesh registered
