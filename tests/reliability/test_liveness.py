"""Liveness of local workers: a SIGSTOPped worker is noticed (``unresponsive`` in
status(), and again when it answers), and with a ``liveness_timeout`` the calls
waiting on it fail with WorkerUnresponsive instead of waiting forever. Real
worker processes, real signals."""

from __future__ import annotations

import os
import pickle
import signal

import pytest
import torch
from reliability_helpers import wait_for

import monarch_nb as mnb
from monarch_nb.ui import render


def _rank_status(mesh, rank):
    return mesh.status()["ranks"][rank]


@pytest.fixture(scope="module")
def watched():
    m = mnb.local_mesh(dp=2, name="watched", heartbeat_timeout=2.0)
    yield m
    m.shutdown()


def test_a_stopped_worker_is_unresponsive_then_recovers(watched):
    pid = _rank_status(watched, 1)["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: _rank_status(watched, 1)["unresponsive"], 20, "rank 1 unresponsive")
        st = watched.status()["ranks"]
        assert st[0]["unresponsive"] is False and st[1]["alive"] is True
        text, red = render.heartbeat(st[1])
        assert red and text.startswith("unresponsive "), text
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(lambda: not _rank_status(watched, 1)["unresponsive"], 20, "rank 1 answering again")
    # no liveness_timeout on a local mesh by default: nothing failed, the mesh serves
    assert mnb.remote(torch.ones)(2, mesh=watched).fetch(timeout=60)[1].tolist() == [1.0, 1.0]


def test_past_the_liveness_timeout_pending_calls_fail_naming_the_worker():
    m = mnb.local_mesh(dp=2, name="lost", heartbeat_timeout=1.0, liveness_timeout=3.0)
    try:
        st = _rank_status(m, 1)
        pid, host = st["pid"], st["host"]
        os.kill(pid, signal.SIGSTOP)
        try:
            ref = mnb.remote(torch.ones)(2, mesh=m)
            with pytest.raises(mnb.WorkerUnresponsive) as ei:
                ref.fetch(timeout=60)  # before: waited forever for the stopped rank
            e = ei.value
            assert isinstance(e, mnb.WorkerCrashed) and isinstance(e, mnb.RemoteError)
            assert (e.rank, e.pid, e.host) == (1, pid, host) and e.silent_for > 3.0
            msg = str(e)
            assert f"worker rank 1 of mesh 'lost' is unresponsive (pid {pid} on {host}" in msg
            assert "mesh.restart()" in msg
            again = pickle.loads(pickle.dumps(e))
            assert type(again) is mnb.WorkerUnresponsive and again.pid == pid
            with pytest.raises(mnb.WorkerUnresponsive, match="needs a restart"):
                mnb.remote(torch.ones)(2, mesh=m).fetch(timeout=60)
        finally:
            os.kill(pid, signal.SIGCONT)
        m.restart()
        assert mnb.remote(torch.ones)(2, mesh=m).fetch(timeout=60)[0].tolist() == [1.0, 1.0]
    finally:
        m.shutdown()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(heartbeat_timeout=0), "heartbeat_timeout=0: a number > 0"),
        (dict(liveness_timeout=-1), "liveness_timeout must be > 0 s or None, got -1"),
    ],
)
def test_bad_timeouts_are_refused_before_any_worker_starts(kwargs, message, worker_children):
    before = len(worker_children())
    with pytest.raises(ValueError, match=message):
        mnb.local_mesh(dp=1, name="bad-timeouts", **kwargs)
    assert len(worker_children()) == before
    assert "bad-timeouts" not in mnb.api.mesh.all_meshes()


def _spin_here_until(path: str):
    import os as _os
    import time as _time

    while not _os.path.exists(path):  # the frame mesh.stacks() must find
        _time.sleep(0.01)
    return "released"


def _spin_in_two_places(first: str, then: str):
    """Spins in ``_spin_here_until(first)``, then in ``_spin_there_until(then)``."""
    _spin_here_until(first)
    return _spin_there_until(then)


def _spin_there_until(path: str):
    return _spin_here_until(path)


def _all_threads_stopped(pid: int) -> bool:
    """Each of the process's threads in state T (/proc/PID/task/TID/stat, field 3)."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            states.append(f.read().rsplit(")", 1)[1].split()[0])
    return all(s == "T" for s in states)


def test_stacks_show_where_each_rank_is_and_a_silent_rank_as_none(watched, tmp_path):
    flag = str(tmp_path / "release")
    ref = mnb.remote(_spin_here_until)(flag, mesh=watched)
    stacks = wait_for(
        lambda: (
            (s := watched.stacks(timeout=10))
            and all("_spin_here_until" in s[r]["default"]["stack"] for r in (0, 1))
            and s
        ),
        30,
        "both ranks in _spin_here_until",
    )
    for r in (0, 1):
        default = stacks[r]["default"]
        assert default["running"] and "test_liveness.py" in default["stack"]
        assert default["stack"].startswith('  File "')
        assert "monarch_nb/worker" not in default["stack"]  # the worker's own frames hidden
        assert "<frozen runpy>" not in default["stack"]
    pid = _rank_status(watched, 1)["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        # every thread of it stopped before it is asked (kill returns before they stop)
        wait_for(lambda: _all_threads_stopped(pid), 10, "every thread of rank 1 stopped")
        # rank 1 never answers, so this waits the whole timeout; rank 0's answer must
        # arrive within it on a loaded machine too
        silent = watched.stacks(timeout=3.0)
        assert silent[1] is None and "_spin_here_until" in silent[0]["default"]["stack"]
    finally:
        os.kill(pid, signal.SIGCONT)
    open(flag, "w").close()
    assert ref.fetch(timeout=60) == ["released", "released"]
    idle = watched.stacks(timeout=10)
    assert idle[0]["default"] == {"running": None, "stack": ""}


def test_a_stalled_stream_shows_where_it_is_in_status_and_the_dashboard(monkeypatch, tmp_path):
    monkeypatch.setenv("MONARCH_NB_STALL_SECONDS", "1")  # read by the workers at start
    m = mnb.local_mesh(dp=1, name="stalling")
    try:
        here, there = str(tmp_path / "here"), str(tmp_path / "there")
        ref = mnb.remote(_spin_in_two_places)(here, there, mesh=m)

        def stall():
            return m.status()["ranks"][0]["streams"]["default"]["stalled"]

        def stalled_in(function: str, not_in: str | None = None):
            def where():
                st = stall()
                if st is None or function not in st["stack"]:
                    return None
                return st if not_in is None or not_in not in st["stack"] else None

            return where

        # the first report may catch the command in an import (a loaded machine), which
        # the next look, stall_seconds later, replaces
        here_stall = stalled_in("_spin_here_until", "_spin_there_until")
        st = wait_for(here_stall, 30, "the stall report, here", show=stall)
        assert "monarch_nb/worker" not in st["stack"]
        assert st["what"] == "_spin_in_two_places" and st["for"] >= 1.0
        html = render.queues_html(m.status())
        assert "mnb-stall" in html and "_spin_here_until" in html
        open(here, "w").close()  # it moves on: the report follows it
        st = wait_for(stalled_in("_spin_there_until"), 30, "the stall report, there", show=stall)
        assert st["what"] == "_spin_in_two_places"
        assert "_spin_there_until" in render.queues_html(m.status())
        open(there, "w").close()
        assert ref.fetch(timeout=60) == ["released"]
        wait_for(lambda: stall() is None, 30, "the stall cleared once the command finished")
        assert "mnb-stall" not in render.queues_html(m.status())
    finally:
        m.shutdown()


def test_status_never_raises_while_sessions_pause_and_resume(watched):
    import threading

    errors, stop = [], threading.Event()

    def hammer():  # status() read all the time, while the IO thread updates the pauses
        while not stop.is_set():
            try:
                watched.status()
            except Exception as e:  # noqa: BLE001 - any failure is the finding
                errors.append(e)

    t = threading.Thread(target=hammer)
    t.start()
    try:
        r = watched.exec("hits = 0\nfor i in range(15):\n    breakpoint()\n    hits += 1\nhits")
        dbg = watched.debugger
        for _ in range(15):
            assert dbg.wait_any(30, count=2), "both ranks paused again"
            dbg.continue_all()
            wait_for(lambda: not dbg.waiting() or len(dbg.waiting()) == 2, 30, "a pause settled")
        assert r.fetch(timeout=60) == [15, 15]
    finally:
        stop.set()
        t.join(30)
    assert errors == []
