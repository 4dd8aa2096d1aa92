"""A slice of a mesh acts on its own ranks: its interrupt stops only them, and the
life-cycle calls that would act on the whole mesh (shutdown, restart, ``with``)
say so instead of stopping the other ranks' workers. Real workers."""

from __future__ import annotations

import pytest
import torch
from reliability_helpers import wait_for
from worker_probes import rank_pids

import monarch_nb as mnb

LOOP = "import time\nfor i in range(3000):\n    time.sleep(0.01)\n'finished'"


def _running(mesh, rank):
    return mesh.status()["ranks"][rank]["streams"]["default"]["running"]


def test_a_slice_interrupts_only_its_ranks(mesh):
    r = mesh.exec(LOOP)
    wait_for(lambda: _running(mesh, 0) and _running(mesh, 1), 30, "both ranks looping")
    mesh.slice(dp=1).interrupt(timeout=10)
    wait_for(lambda: not _running(mesh, 1), 30, "rank 1 stopped")
    assert _running(mesh, 0), "rank 0, outside the slice, was interrupted too"
    mesh.interrupt(timeout=10)
    with pytest.raises(mnb.RemoteError) as ei:
        r.fetch(timeout=30)
    assert sorted(ei.value.failures) == [0, 1]
    assert all(f[0] == "KeyboardInterrupt" for f in ei.value.failures.values())
    assert mnb.remote(torch.ones)(1, mesh=mesh).fetch(timeout=30)[1].tolist() == [1.0]


@pytest.mark.parametrize("call", ["shutdown", "restart", "with"])
def test_life_cycle_calls_on_a_slice_say_they_act_on_the_whole_mesh(mesh, call):
    sub = mesh.slice(dp=0)
    pids = rank_pids(mesh)
    with pytest.raises(ValueError, match=rf"acts on the whole mesh {mesh.name!r}.*ranks \[0\]"):
        if call == "with":
            with sub:
                pass
        else:
            getattr(sub, call)()
    assert rank_pids(mesh) == pids and mesh.alive
    assert mnb.remote(torch.ones)(1, mesh=sub).fetch(timeout=30) == [torch.ones(1)]


class SlowToPickle:
    """A value whose pickling takes a while: the window an interrupt must not lose."""

    def __reduce__(self):
        import time

        time.sleep(0.3)
        return (SlowToPickle, ())


def make_slow_to_pickle():
    return SlowToPickle()


def test_an_interrupt_while_a_reply_is_made_never_loses_it(mesh):
    """Interrupts fired while values are pickled and sent: each fetch gets its value
    or the interrupt's KeyboardInterrupt, never silence (an interrupt landing inside
    the worker's own send of the reply used to lose it: the fetch waited forever)."""
    import threading

    side = mesh.stream("sender")
    slow = mnb.remote(make_slow_to_pickle)(mesh=mesh, stream=side)
    slow.fetch(rank=1, timeout=30)  # made, and it pickles
    stop = threading.Event()
    io = mesh._controller.io
    backlog = [0]

    def storm():
        while not stop.is_set():
            mesh.interrupt()
            backlog[0] = max(backlog[0], len(io._outq))

    t = threading.Thread(target=storm)
    t.start()
    outcomes = []
    try:
        for _ in range(4):
            try:
                outcomes.append(type(slow.fetch(rank=1, timeout=30)).__name__)
            except mnb.RemoteError as e:
                assert "KeyboardInterrupt" in str(e), e
                outcomes.append("interrupted")
    finally:
        stop.set()
        t.join()
    assert len(outcomes) == 4 and "interrupted" in outcomes, outcomes
    # a producer faster than the socket helps send: the backlog stays bounded (it once
    # grew without end, and with it the batch being built, to an out-of-memory kill)
    from monarch_nb.controller.io_loop import MAX_QUEUED

    assert backlog[0] <= MAX_QUEUED + 64, backlog
    assert mnb.remote(torch.ones)(1, mesh=mesh, stream=side).fetch(timeout=30)[0].tolist() == [1.0]
