"""Requests with lifetimes: AsyncResult, deadlines, cancels, awaiting, partial
results, run_cell as one command, and IO-thread failures that fail requests.
Real workers, real sockets; one dp=2 mesh for the module."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import CancelledError

import pytest
from wait_helpers import file_appears, wait_for, wait_running

import monarch_nb as mnb
from monarch_nb.protocol import messages as m

LOOP = "import time\nfor _ in range(6000):\n    time.sleep(0.01)\n"


def add(a, b):
    return a + b


def held_on_rank(rank: int, gate: str):
    """Rank ``rank`` waits (bounded) for the file ``gate``; the others answer at once."""
    import monarch_nb as mnb

    if mnb.current_rank() == rank:
        file_appears(gate, 60)
    return mnb.current_rank()


@pytest.fixture(scope="module")
def mesh():
    mesh = mnb.local_mesh(dp=2, name="requests")
    yield mesh
    mesh.shutdown()


def open_requests(mesh) -> int:
    return mesh.status()["requests"]


def no_open_requests(mesh) -> None:
    wait_for(lambda: open_requests(mesh) == 0, 10, "the request table to empty")


def test_fetch_async_is_an_async_result(mesh):
    res = mnb.remote(add)(1, 2, mesh=mesh).fetch_async()
    assert isinstance(res, mnb.AsyncResult)
    assert res.result(timeout=30) == [3, 3]
    assert res.done() and not res.cancelled() and res.ranks_pending == []
    assert res.partial == {0: 3, 1: 3}
    no_open_requests(mesh)


def test_a_deadline_fails_the_fetch_and_frees_its_entry(mesh):
    busy = mesh.run_cell(LOOP, what="busy")
    wait_running(mesh, [0, 1], what="busy")
    with pytest.raises(TimeoutError, match=r"did not finish within 0.3 s .*it was cancelled"):
        mnb.remote(add)(1, 2, mesh=mesh).fetch(timeout=0.3)
    wait_for(lambda: open_requests(mesh) == 1, 10, "only the busy cell's request to stay")
    mesh.interrupt()
    with pytest.raises(mnb.RemoteError, match="KeyboardInterrupt"):
        busy.result(timeout=30)
    no_open_requests(mesh)
    mesh.wait(timeout=30)  # the cell's failure was reported by its result
    assert mnb.remote(add)(2, 2, mesh=mesh).fetch(timeout=30) == [4, 4]


def test_partial_results_arrive_per_rank(mesh, tmp_path):
    gate = str(tmp_path / "gate")
    res = mnb.remote(held_on_rank)(1, gate, mesh=mesh).fetch_async()
    wait_for(lambda: res.partial == {0: 0}, 30, "rank 0's value", show=lambda: res)
    assert res.ranks_pending == [1] and not res.done()
    assert "pending on rank(s) [1]" in repr(res)
    open(gate, "w").close()
    assert res.result(timeout=30) == [0, 1]


def test_cancel_interrupts_a_running_cell(mesh):
    res = mesh.run_cell(LOOP, what="long cell")
    wait_running(mesh, [0, 1], what="long cell")
    assert res.cancel() is True
    assert res.cancel() is False  # a second cancel: already cancelled
    assert res.cancelled() and res.done()
    with pytest.raises(CancelledError):
        res.result(timeout=5)
    wait_for(
        lambda: all(
            r["streams"]["default"]["running"] is None for r in mesh.status()["ranks"].values()
        ),
        30,
        "the cancelled cell to stop on every rank",
    )
    mesh.wait(timeout=30)  # the user cancelled it: no failure to report
    no_open_requests(mesh)
    assert mnb.remote(add)(1, 1, mesh=mesh).fetch(timeout=30) == [2, 2]


def test_cancel_drops_a_command_before_it_starts(mesh):
    blocker = mesh.run_cell(LOOP, what="blocker")
    wait_running(mesh, [0, 1], what="blocker")
    queued = mesh.run_cell("dropped_ran = True", what="queued")
    assert queued.cancel()
    blocker.cancel()
    mesh.wait(timeout=30)
    with pytest.raises(mnb.RemoteError, match="name 'dropped_ran' is not defined"):
        mesh.pull("dropped_ran", timeout=30)


def test_run_cell_is_one_command_with_values_and_failures(mesh):
    done = mesh.run_cell("x = 40 + rank\nx").result(timeout=30)
    assert [r["data"]["text/plain"] for r in done] == ["40", "41"]
    res = mesh.run_cell("if rank == 1:\n    raise ValueError('only rank 1')\n'fine'")
    with pytest.raises(mnb.RemoteError) as ei:
        res.result(timeout=30)
    err = ei.value
    assert isinstance(err, ValueError) and sorted(err.failures) == [1]
    assert err.results[0]["data"]["text/plain"] == "'fine'" and err.results[1]["data"] is None
    mesh.wait(timeout=30)  # reported once, by the result


def run_loop(coroutine_fn):
    """asyncio.run in a thread of its own: the kernel's loop, as a test sees it (this
    thread may hold a loop of an earlier test's library, e.g. Playwright's)."""
    out: list = []

    def run():
        try:
            out.append(("ok", asyncio.run(coroutine_fn())))
        except BaseException as e:  # noqa: B036 - handed to the test thread
            out.append(("err", e))

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert out, "the loop did not finish within 60 s"
    kind, value = out[0]
    if kind == "err":
        raise value
    return value


def test_await_in_an_asyncio_loop(mesh):
    async def main():
        return await mnb.remote(add)(3, 4, mesh=mesh).fetch_async()

    assert run_loop(main) == [7, 7]


def test_await_of_a_mesh_shut_down_meanwhile(tmp_path):
    small = mnb.local_mesh(dp=1, name="requests-short")
    gate = str(tmp_path / "never")
    res = mnb.remote(held_on_rank)(0, gate, mesh=small).fetch_async()

    async def main():
        small.shutdown()
        return await res

    with pytest.raises(mnb.MeshClosedError, match="was shut down"):
        run_loop(main)
    with pytest.raises(mnb.MeshClosedError):
        res.result(timeout=5)


def test_a_failing_io_thread_handler_fails_the_request(mesh):
    replies = mesh._controller.replies
    real = replies._handlers[m.FetchResult]

    def broken(msg):
        raise RuntimeError("a bug in the FetchResult handler")

    replies._handlers[m.FetchResult] = broken  # fault injection into the real IO thread
    try:
        with pytest.raises(mnb.IOThreadError, match="a bug in the FetchResult handler") as ei:
            mnb.remote(add)(1, 2, mesh=mesh).fetch(timeout=30)
        assert "failed handling FetchResult from rank" in str(ei.value)
        assert "Traceback" in str(ei.value)
    finally:
        replies._handlers[m.FetchResult] = real
    no_open_requests(mesh)
    assert mnb.remote(add)(1, 2, mesh=mesh).fetch(timeout=30) == [3, 3]


def test_bad_deadlines_are_refused(mesh):
    ref = mnb.remote(add)(1, 2, mesh=mesh)
    for bad in (0, -1, -0.5):
        with pytest.raises(ValueError, match=r"timeout must be > 0 seconds"):
            ref.fetch(timeout=bad)
    with pytest.raises(TypeError, match="timeout must be a number"):
        ref.fetch(timeout="soon")
    res = ref.fetch_async()
    with pytest.raises(ValueError, match=r"timeout must be > 0"):
        res.result(timeout=0)
    assert res.result(timeout=30) == [3, 3]
    no_open_requests(mesh)


def test_a_restart_fails_pending_requests_and_leaves_none(mesh, tmp_path):
    gate = str(tmp_path / "never-restart")
    pending = mnb.remote(held_on_rank)(1, gate, mesh=mesh).fetch_async()
    wait_for(lambda: pending.partial == {0: 0}, 30, "rank 0's value")
    mesh.restart()
    with pytest.raises(mnb.MeshClosedError, match="was shut down"):
        pending.result(timeout=5)
    no_open_requests(mesh)
    assert mnb.remote(add)(5, 5, mesh=mesh).fetch(timeout=30) == [10, 10]
