"""Workers tier: the DeviceMesh members front ends use instead of the controller
(api.md, "For front ends"): the mesh's key and generation, its streams, whether it
takes commands, a command's failures, the output handler, and one stream's interrupt."""

import os

import pytest
from wait_helpers import file_appears, running, wait_for, wait_running

import monarch_nb as mnb


def mark_then_sleep(path: str, seconds: float) -> None:
    import time

    open(f"{path}-{mnb.current_rank()}", "w").close()
    time.sleep(seconds)


def test_a_key_is_shared_by_slices_and_kept_across_a_restart(mesh):
    assert isinstance(mesh.key, int) and mesh.slice(dp=1).key == mesh.key
    mesh.check_usable()  # a healthy mesh: nothing raised
    with mnb.local_mesh(dp=1, name="front-end") as other:
        key = other.key
        assert key != mesh.key and other.generation == 0
        other.restart()
        assert other.key == key and other.generation == 1
        other.check_usable()
    assert other.closed
    with pytest.raises(mnb.MeshClosedError, match="'front-end' is shut down"):
        other.check_usable()


def test_streams_output_handler_and_failure_of(mesh):
    named = mesh.stream("front-end")
    streams = mesh.streams
    assert streams["default"].id == 0 and streams["front-end"].id == named.id
    assert "never-made" not in streams

    seen: list = []
    old = mesh.output_handler
    mesh.output_handler = seen.append
    try:
        assert mesh.exec("print('hello from', rank)").fetch(timeout=30) == [None, None]
        wait_for(lambda: len(seen) >= 2, 30, "both ranks' output")
    finally:
        mesh.output_handler = old
    assert sorted((o.rank, o.name, o.text) for o in seen) == [
        (0, "stdout", "hello from 0\n"),
        (1, "stdout", "hello from 1\n"),
    ]
    mesh.output_handler = None  # prints again
    try:
        assert mesh.output_handler.__name__ == "print_output"
    finally:
        mesh.output_handler = old

    fut = mesh.run_cell("raise ValueError('front-end boom')", ranks=[0])
    wait_for(fut.done, 30, "the cell to fail")
    err = mesh.failure_of(fut.ident)
    assert isinstance(err, mnb.RemoteError) and set(err.failures) == {0}
    assert "front-end boom" in str(err)
    assert mesh.failure_of(mesh.exec("1").ident) is None
    mesh.wait()  # the failure counts as raised: wait() does not raise it again


def test_a_streams_interrupt_stops_only_that_stream(mesh, tmp_path):
    mark, gate = tmp_path / "sleep", tmp_path / "gate"
    side = mesh.stream("front-end-side")
    sleeping = mnb.remote(mark_then_sleep)(str(mark), 1000, mesh=mesh, stream=side)
    held = mnb.remote(file_appears)(str(gate), 60, mesh=mesh)
    try:
        wait_for(lambda: all(os.path.exists(f"{mark}-{r}") for r in (0, 1)), 30, "the sleeps")
        wait_running(mesh, [0, 1])  # the default stream waits for the gate
        # The mark is written before the rank's report that the sleep started can
        # arrive: wait for the reports, or rank 0's "stopped" below proves nothing.
        wait_running(mesh, [0, 1], side.name)
        side.interrupt(ranks=[0])
        wait_for(lambda: running(mesh, 0, side.name) is None, 30, "rank 0's sleep to stop")
        assert running(mesh, 1, side.name) is not None  # rank 1 sleeps on
        side.interrupt()
        with pytest.raises(mnb.RemoteError, match="KeyboardInterrupt") as ei:
            sleeping.fetch(timeout=30)
        assert set(ei.value.failures) == {0, 1}
        assert running(mesh, 0) is not None and running(mesh, 1) is not None
    finally:
        gate.touch()
    assert held.fetch(timeout=30) == [True, True]  # saw the gate: never interrupted
