"""No failure poisons the tensor engine, and Ctrl-C always lands: a failure injected
at each stage of an op (planning, a user propagator, dispatching, sending) leaves the
plan cache, the mode stack and every mesh tensor as they were, and the next op works;
a Ctrl-C in a loop of mesh-tensor ops is raised every time (real dp=2 mesh)."""

from __future__ import annotations

import gc
import signal
import threading
import time

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import monarch_nb as mnb
from monarch_nb.api.tensor import dispatch as tensor_dispatch
from monarch_nb.api.tensor import plans as tensor_plans
from monarch_nb.controller import PENDING_INTERRUPT, Controller, raise_pending_interrupt


@pytest.fixture(scope="module")
def mesh():
    m = mnb.local_mesh(dp=2, name="tensor-faults")
    try:
        yield m
    finally:
        m.shutdown()


def double(t):
    return t * 2


def _modes() -> int:
    return len(_get_current_dispatch_mode_stack())


def test_a_propagator_runs_on_fakes_with_the_mesh_mode_off(mesh):
    """Issue 26: ``t + 1`` in a propagator inside activate() recursed, and every later
    op of that layout raised RecursionError until a restart."""
    with mesh.activate():
        x = torch.ones(7, 3)
        y = mnb.remote(double, propagate=lambda t: t + 1)(x)
        z = x + 1  # the same layout: a plain op after the propagator
    assert y.shape == (7, 3)
    assert torch.equal(mnb.inspect(y, dp=1), torch.full((7, 3), 2.0))
    assert torch.equal(mnb.inspect(z, dp=1), torch.full((7, 3), 2.0))


def _recursing(t):
    return _recursing(t)


def _raising(t):
    raise ValueError("no layout for you")


@pytest.mark.parametrize(
    "propagate, error, match",
    [
        (_recursing, RuntimeError, "propagator of double recursed"),
        (_raising, RuntimeError, "propagator of double raised ValueError: no layout for you"),
        (lambda t: None, TypeError, "propagator of double returned NoneType"),
    ],
)
def test_a_failing_propagator_is_a_short_error_and_the_next_op_works(mesh, propagate, error, match):
    with mesh.activate():
        x = torch.ones(5, 11)
        depth = _modes()
        with pytest.raises(error, match=match) as info:
            mnb.remote(double, propagate=propagate)(x)
        assert len(str(info.value)) < 300
        assert _modes() == depth
        y = x * 3
    assert torch.equal(mnb.inspect(y, dp=0), torch.full((5, 11), 3.0))


class Injected(Exception):
    pass


def _fail_once(monkeypatch, owner, name: str, exc: BaseException):
    original = getattr(owner, name)
    calls = []

    def failing(*args, **kwargs):
        if not calls:
            calls.append(1)
            raise exc
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)
    return calls


@pytest.mark.parametrize(
    "stage", ["planning", "dispatching", "sending", "sending-interrupted", "finishing"]
)
def test_a_failure_at_any_stage_leaves_the_engine_as_it_was(mesh, monkeypatch, stage):
    exc = KeyboardInterrupt() if stage == "sending-interrupted" else Injected(stage)
    owner, name = {
        "planning": (tensor_dispatch, "plan"),
        "dispatching": (tensor_dispatch, "target"),
        "sending": (Controller, "send_op"),
        "sending-interrupted": (Controller, "send_op"),
        "finishing": (tensor_dispatch, "_output"),
    }[stage]
    with mesh.activate():
        x = torch.arange(6.0).reshape(2, 3) + {"planning": 0.5}.get(stage, 0)  # a new layout?
        x = x.t().contiguous() if stage == "planning" else x
        before = (x.id, x._layout, len(tensor_plans._plans), _modes())
        calls = _fail_once(monkeypatch, owner, name, exc)
        with pytest.raises(type(exc)):
            x.mul(2.0).sin()
        assert calls
        assert (x.id, x._layout, _modes()) == before[:2] + before[3:]
        if stage == "planning":  # nothing cached for the failed key
            assert len(tensor_plans._plans) == before[2]
        y = x.mul(2.0).sin()
        w = x * 2.0
    expect = mnb.inspect(x, dp=1) * 2.0
    assert torch.equal(mnb.inspect(w, dp=1), expect)
    assert torch.equal(mnb.inspect(y, dp=1), expect.sin())


def test_ctrl_c_in_a_loop_of_ops_lands_every_time(mesh):
    """Issue 26: in 4 of 6 tries the interrupt landed in a dropped tensor's __del__,
    where Python ignores it, and the loop ran on."""
    _interrupt_a_loop_of_ops(mesh, 20)


def test_a_ctrl_c_landing_in_a_gc_callback_is_handed_back(mesh):
    """A library's gc callback (hypothesis installs one) is a finalizer too: a Ctrl-C
    that lands there was dropped, and the loop ran on."""

    def slow(phase, info):
        if phase == "start":
            time.sleep(0.002)  # where a Ctrl-C lands, often

    threshold = gc.get_threshold()
    gc.callbacks.append(slow)
    gc.set_threshold(20)
    try:
        _interrupt_a_loop_of_ops(mesh, 10, after=20)
        # a loop of remote calls (their Refs dropped at once) too
        _interrupt_a_loop_of_ops(mesh, 5, after=20, body=lambda x: (noop(mesh=mesh), x)[1])
    finally:
        gc.callbacks.remove(slow)
        gc.set_threshold(*threshold)


@mnb.remote
def noop():
    return None


def _interrupt_a_loop_of_ops(mesh, times: int, after: int = 200, body=None) -> None:
    """Ctrl-C ``times`` times, each once ``after`` ops (``body(x)``) ran: each one lands
    within the loop (which would run on for 20 s without it), within a second of the
    press, and once (no Ctrl-C a finalizer dropped is left to be raised later)."""
    main = threading.main_thread().ident
    late = []
    with mesh.activate():
        x = torch.ones(16)
        for _ in range(times):
            fired, pressed = threading.Event(), []

            def press(fired=fired, pressed=pressed):
                if fired.wait(30):  # (never a stray press after its loop)
                    pressed.append(time.monotonic())
                    signal.pthread_kill(main, signal.SIGINT)

            presser = threading.Thread(target=press, daemon=True)
            presser.start()
            start, i = time.monotonic(), 0
            with pytest.raises(KeyboardInterrupt):
                while time.monotonic() - start < 20:  # bounded: a lost Ctrl-C fails, not hangs
                    x = x * 1.0001 if body is None else body(x)
                    i += 1
                    if i == after:
                        fired.set()
            assert fired.is_set(), f"a KeyboardInterrupt nobody pressed, after {i} ops"
            presser.join(30)
            if time.monotonic() - pressed[0] > 1.0:  # the bound: held, not lost
                late.append(round(time.monotonic() - pressed[0], 2))
            assert not PENDING_INTERRUPT, "a dropped Ctrl-C left to be raised a second time"
            mesh.wait(timeout=60)
        x = x * 1.0  # and the engine goes on
    assert late == [], f"Ctrl-Cs that took over 1 s to land (s): {late}"
    assert mnb.inspect(x).shape == (16,)


def test_no_mesh_takes_the_mesh_mode_off_torch_s_stack(mesh):
    """Local torch inside ``no_mesh()`` runs at its own speed: no mode of ours sees its
    ops (issue 26: a local step ran at half speed inside activate() + no_mesh())."""
    from monarch_nb.api.tensor.mode import MeshMode

    def ours() -> int:
        return sum(type(m) is MeshMode for m in _get_current_dispatch_mode_stack())

    with mesh.activate():
        assert ours() == 1
        with mnb.no_mesh():
            assert ours() == 0
            local = torch.ones(3) * 2
            with mesh.activate():  # a mesh again, inside
                again = torch.ones(3) * 2
            assert ours() == 0
        assert ours() == 1
        after = torch.ones(3) * 2
    assert not isinstance(local, mnb.Tensor) and torch.equal(local, torch.full((3,), 2.0))
    assert isinstance(again, mnb.Tensor) and isinstance(after, mnb.Tensor)
    assert ours() == 0


@pytest.mark.unit
def test_a_dropped_ctrl_c_is_raised_once_and_on_the_main_thread_only():
    """The token a finalizer's dropped Ctrl-C leaves: an op on another thread leaves
    it (that thread was not interrupted); the main thread's next op raises it, once."""
    PENDING_INTERRUPT.append(True)  # as the unraisable hook leaves it
    try:
        seen = []
        other = threading.Thread(target=lambda: seen.append(raise_pending_interrupt()))
        other.start()
        other.join(10)
        assert seen == [None] and PENDING_INTERRUPT == [True]
        with pytest.raises(KeyboardInterrupt):
            raise_pending_interrupt()
        assert PENDING_INTERRUPT == []
        raise_pending_interrupt()  # nothing left: no second KeyboardInterrupt
    finally:
        PENDING_INTERRUPT.clear()


@pytest.mark.unit
def test_the_re_raiser_hands_back_only_the_ctrl_c_it_was_given():
    """A dropped Ctrl-C's token that a mesh op raised first is not raised again, and a
    token the re-raiser was not given is left alone: in CI a test's own token was
    taken by a re-raiser still waiting on an earlier Ctrl-C, and its KeyboardInterrupt
    stopped the run."""
    from types import SimpleNamespace

    from monarch_nb.controller import sigint

    dropped = SimpleNamespace(
        exc_type=KeyboardInterrupt, exc_value=None, exc_traceback=None, err_msg=None, object=None
    )
    try:
        sigint._unraisable(dropped)  # a Ctrl-C a finalizer dropped: its token waits
        assert len(PENDING_INTERRUPT) == 1
        with pytest.raises(KeyboardInterrupt):
            raise_pending_interrupt()  # the next mesh op raised it (the re-raiser waits)
        PENDING_INTERRUPT.append(True)  # someone else's token, never handed to it
        probe = object()  # handed to it after the first: once it is raised, both were seen
        PENDING_INTERRUPT.append(probe)
        sigint._reraiser().put(probe)
        deadline = time.monotonic() + 10
        with pytest.raises(KeyboardInterrupt):
            while time.monotonic() < deadline:
                time.sleep(0.001)
        assert PENDING_INTERRUPT == [True]
    finally:
        PENDING_INTERRUPT.clear()


@pytest.mark.unit
def test_a_ranks_backward_that_reaches_no_leaf_fails_naming_it_not_a_silent_none():
    """A rank runs torch's engine on its own graph for the leaves the controller's graph
    reaches. Where the two graphs differed (TorchScript's read detached inputs), a leaf
    got no grad there while the controller named one: its value was None, silently."""
    from monarch_nb.protocol.autograd import backward_shards

    reached, missed = torch.ones(2, requires_grad=True), torch.ones(3, requires_grad=True)
    loss = (reached * 2).sum() + (missed.detach() * 3).sum()
    leaves = ((False, (2,), (1,)), (False, (3,), (1,)))
    with pytest.raises(RuntimeError, match=r"gave 1 of the graph's leaves no gradient \(shapes \(3,\)\).*torch.autograd.backward\(loss\)"):
        backward_shards((False, False, leaves), loss, reached, missed)
    loss = (reached * 2).sum() + (missed * 3).sum()
    grads = backward_shards((False, False, leaves), loss, reached, missed)
    assert [g.tolist() for g in grads] == [[2.0, 2.0], [3.0, 3.0, 3.0]]
