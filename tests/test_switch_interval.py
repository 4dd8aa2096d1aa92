"""While a mesh runs, the process's GIL switch interval is at most
``MonarchNB.switch_interval`` (controller/switch_interval.py); it is set back after
the last mesh unless someone changed it meanwhile."""

from __future__ import annotations

import sys

import pytest

import monarch_nb as mnb
from monarch_nb import config
from monarch_nb.config import ConfigError
from monarch_nb.controller import switch_interval


@pytest.fixture
def interval():
    """The process's interval, 5 ms (Python's default) for the test, put back after."""
    before = sys.getswitchinterval()
    if switch_interval._holders[0] == 0:
        sys.setswitchinterval(0.005)
    yield
    if switch_interval._holders[0] == 0:
        sys.setswitchinterval(before)


def _close(a: float, b: float) -> bool:
    return abs(a - b) < 1e-9


@pytest.mark.unit
def test_the_interval_is_lowered_while_held_and_set_back_after(interval):
    seen = []
    switch_interval.holding(lambda: seen.append(sys.getswitchinterval()), 0.001)()
    assert _close(seen[0], 0.001)
    assert _close(sys.getswitchinterval(), 0.005)


@pytest.mark.unit
def test_it_is_set_back_only_after_the_last_holder_and_never_raised(interval):
    seen = []

    def outer():
        # a second mesh asking for more than now leaves it; one asking less lowers it
        switch_interval.holding(lambda: seen.append(sys.getswitchinterval()), 0.002)()
        switch_interval.holding(lambda: seen.append(sys.getswitchinterval()), 0.0005)()
        seen.append(sys.getswitchinterval())  # the first still runs

    switch_interval.holding(outer, 0.001)()
    assert [round(s, 6) for s in seen] == [0.001, 0.0005, 0.0005]
    assert _close(sys.getswitchinterval(), 0.005)


@pytest.mark.unit
def test_a_users_own_change_meanwhile_stays_and_zero_leaves_it_alone(interval):
    switch_interval.holding(lambda: sys.setswitchinterval(0.002), 0.001)()
    assert _close(sys.getswitchinterval(), 0.002)  # theirs, not set back to 5 ms
    sys.setswitchinterval(0.005)
    seen = []
    switch_interval.holding(lambda: seen.append(sys.getswitchinterval()), 0.0)()
    assert _close(seen[0], 0.005)


@pytest.mark.unit
def test_a_failing_run_still_lets_go(interval):
    def boom():
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        switch_interval.holding(boom, 0.001)()
    assert _close(sys.getswitchinterval(), 0.005)


def test_a_mesh_lowers_it_while_it_runs_and_the_setting_picks_how_far(interval):
    others = switch_interval._holders[0]  # meshes an earlier test left running hold it too
    with mnb.local_mesh(dp=1, name="gil") as m:
        assert sys.getswitchinterval() <= 0.001 + 1e-9
        m.exec("a = 1")  # the mesh serves while it is lowered
        assert m.pull("a") == [1]
    if others:
        return
    assert _close(sys.getswitchinterval(), 0.005)
    own = config.settings()
    own.switch_interval = 0  # as %config MonarchNB.switch_interval = 0 does
    try:
        with mnb.local_mesh(dp=1, name="gil0"):
            assert _close(sys.getswitchinterval(), 0.005)
    finally:
        own.set_here.discard("switch_interval")


@pytest.mark.unit
def test_a_negative_interval_is_refused_naming_the_setting():
    with pytest.raises(ConfigError, match=r"MONARCH_NB_SWITCH_INTERVAL='-1': a number >= 0"):
        config.snapshot({"MONARCH_NB_SWITCH_INTERVAL": "-1"})
    with pytest.raises(Exception, match=r"switch_interval must be >= 0"):
        config.settings().switch_interval = -1
    assert "switch_interval" not in config.settings().set_here  # nothing half-set


@pytest.mark.unit
def test_a_mesh_port_that_is_taken_is_refused_naming_the_address():
    import zmq

    from monarch_nb.controller.routing import bind_router

    ctx = zmq.Context()
    try:
        first, port = bind_router(ctx, "one", "127.0.0.1")
        try:
            with pytest.raises(OSError, match=rf"mesh 'two': cannot listen on 127.0.0.1:{port}"):
                bind_router(ctx, "two", "127.0.0.1", port)
        finally:
            first.close()
    finally:
        ctx.term()
