"""Workers tier: a worker's socket changes hands (worker/connection.py). The default
stream's thread receives while it is idle; once it runs a command, the receiver
thread takes the socket over, so that other streams, pings and interrupts are served
meanwhile; the idle thread then asks for it back. A worker idle a while sleeps (its
receiver thread parked until the next command, its idle thread polling slowly) and
wakes for a command or for output of a thread of the user's."""

import os

import pytest
from wait_helpers import file_appears, wait_for

import monarch_nb as mnb


def held(gate: str) -> str:
    open(f"{gate}-started-{mnb.current_rank()}", "w").close()
    return "released" if file_appears(gate) else "never released"


def wait_started(gate: str) -> None:
    """Until ``held(gate)`` runs user code on both ranks."""
    paths = [f"{gate}-started-{r}" for r in (0, 1)]
    wait_for(lambda: all(os.path.exists(p) for p in paths), 30, f"{paths} written")


def echo(x):
    return x


def test_other_streams_are_served_while_the_default_stream_is_held_and_back_again(
    mesh, tmp_path
):
    side = mesh.stream("handover")
    for i in range(12):
        gate = str(tmp_path / f"gate-{i}")
        blocked = mnb.remote(held)(gate, mesh=mesh)
        wait_started(gate)
        # sent once the default stream's thread is in user code: only the receiver
        # thread, taking the socket over, can answer it
        assert mnb.remote(echo)(i, mesh=mesh, stream=side).fetch(timeout=30) == [i, i]
        assert mesh.stacks(timeout=10)[0]["default"]["running"]
        open(gate, "w").close()
        assert blocked.fetch(timeout=30) == ["released", "released"]
        # the default stream, idle again, has taken the socket back (or waits for it)
        assert mnb.remote(echo)(-i, mesh=mesh).fetch(timeout=30) == [-i, -i]


def test_an_interrupt_reaches_a_command_started_on_an_idle_worker(mesh, tmp_path):
    gate = str(tmp_path / "never")
    ref = mnb.remote(held)(gate, mesh=mesh)
    wait_started(gate)  # sent once the command is in user code on both ranks
    mesh.interrupt()
    with pytest.raises(mnb.RemoteError, match="KeyboardInterrupt"):
        ref.fetch(timeout=30)
    assert not os.path.exists(gate)
    assert mnb.remote(echo)(7, mesh=mesh).fetch(timeout=30) == [7, 7]


def slow_steps(path: str) -> int:
    """Sixty 0.5 s sleeps, a line in ``path`` after each: a command that an interrupt
    ends within one step, and whose file shows whether it ran on."""
    import time

    for i in range(60):
        time.sleep(0.5)
        with open(f"{path}-{mnb.current_rank()}", "a") as f:
            f.write(f"{i}\n")
    return 60


@pytest.mark.parametrize("stream", ["default", "side"])
def test_an_interrupt_sent_before_its_command_starts_lands_in_it(mesh, tmp_path, stream):
    # sent right after the call: the command may not have started, or be queued in the
    # same batch as the interrupt; it must not run on to its end either way
    on = None if stream == "default" else mesh.stream("side-interrupt")
    for i in range(10):
        path = str(tmp_path / f"steps-{stream}-{i}")
        ref = mnb.remote(slow_steps)(path, mesh=mesh, stream=on)
        mesh.interrupt()
        with pytest.raises(mnb.RemoteError, match="KeyboardInterrupt") as e:
            ref.fetch(timeout=20)
        assert sorted(e.value.failures) == [0, 1]
        # ended at its first step or before it: no rank got past a second line
        for r in (0, 1):
            lines = open(f"{path}-{r}").read().split() if os.path.exists(f"{path}-{r}") else []
            assert len(lines) <= 1, (r, lines)
        assert mnb.remote(echo)(i, mesh=mesh, stream=on).fetch(timeout=30) == [i, i]


def test_an_interrupt_of_an_idle_mesh_leaves_the_next_command_alone(mesh):
    assert mnb.remote(echo)(1, mesh=mesh).fetch(timeout=30) == [1, 1]
    mesh.interrupt()  # nothing runs, nothing was sent before it that has not ended
    assert mnb.remote(echo)(2, mesh=mesh).fetch(timeout=30) == [2, 2]
    assert mnb.remote(echo)(3, mesh=mesh, stream=mesh.stream("idle-side")).fetch(timeout=30) == [
        3,
        3,
    ]


def held_until_interrupted(gate: str) -> None:
    """``held``, and a mark when an interrupt ends it."""
    try:
        held(gate)
    except KeyboardInterrupt:
        open(f"{gate}-interrupted-{mnb.current_rank()}", "w").close()
        raise


def touch(path: str) -> None:
    open(f"{path}-{mnb.current_rank()}", "w").close()


@pytest.mark.parametrize("how", ["shutdown", "restart"])
@pytest.mark.parametrize("stream", ["default", "side"])
def test_stopping_a_busy_mesh_interrupts_what_runs_and_starts_nothing_queued(
    tmp_path, stream, how
):
    # before, the workers' Exit let the running command go on: stopping a busy mesh
    # waited out the grace period (5 s; 3 s for a restart), then SIGTERM
    mesh = mnb.local_mesh(dp=2, name=f"busy-{stream}-{how}")
    try:
        on = mesh.stream("side") if stream == "side" else None
        gate, queued = str(tmp_path / "gate"), str(tmp_path / "queued")
        running = mnb.remote(held_until_interrupted)(gate, mesh=mesh, stream=on)
        mnb.remote(touch)(queued, mesh=mesh, stream=on)
        wait_started(gate)
        if how == "restart":
            mesh.restart()
            with pytest.raises(mnb.RefUseError):  # the old generation's, as before
                running.fetch(timeout=30)
            assert mnb.remote(echo)(7, mesh=mesh, stream=on).fetch(timeout=30) == [7, 7]
    finally:
        mesh.shutdown()
    # the workers are gone: what they were to write is written
    assert [os.path.exists(f"{gate}-interrupted-{r}") for r in (0, 1)] == [True, True]
    assert [os.path.exists(f"{queued}-{r}") for r in (0, 1)] == [False, False]


def receiver_parked() -> bool:
    from monarch_nb.worker import current

    return current.worker._receiver_parked


def _parked(mesh, side) -> bool:
    return all(mnb.remote(receiver_parked)(mesh=mesh, stream=side).fetch(timeout=30))


def test_a_parked_receiver_wakes_for_the_command_that_ends_the_idle(mesh):
    side = mesh.stream("probe")
    mesh.exec("import threading\nflag = threading.Event()").fetch(timeout=30)
    wait_for(lambda: _parked(mesh, side), 15, "the idle workers' receivers parked")
    # the default stream busy until the side stream's command sets the flag: only the
    # receiver thread, woken from its wait, can receive that command meanwhile
    busy = mesh.exec("flag.wait(20)")
    mesh.exec("flag.set()", stream=side).fetch(timeout=30)
    assert busy.fetch(timeout=30) == [True, True]


def test_output_of_a_thread_reaches_us_from_a_quiet_worker(mesh):
    side = mesh.stream("probe")
    mesh.exec(
        "import threading\ngo = threading.Event()\n"
        "def late():\n    go.wait(30)\n    print('from a thread', flush=True)\n"
        "threading.Thread(target=late, daemon=True).start()"
    ).fetch(timeout=30)
    wait_for(lambda: _parked(mesh, side), 15, "the idle workers' receivers parked")
    seen = []
    old, mesh.output_handler = mesh.output_handler, seen.append
    try:
        mesh.exec("go.set()", stream=side).fetch(timeout=30)
        ranks = lambda: {o.rank for o in seen if "from a thread" in o.text}  # noqa: E731
        wait_for(lambda: ranks() == {0, 1}, 15, "both ranks' output")
    finally:
        mesh.output_handler = old
