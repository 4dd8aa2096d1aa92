"""The dashboard without a kernel: its drawing (pure functions of ``mesh.status()``),
the rewrite of waiting ``%%monarch`` cells, and a Dashboard on real workers in this
process (widgets work without a kernel; their comms are dummies)."""

from __future__ import annotations

import html
import re
import time

import pytest
from wait_helpers import wait_for

import monarch_nb as mnb
from monarch_nb.notebook import waiting
from monarch_nb.ui import Dashboard, render
from monarch_nb.ui.dashboard import LOOP


def _stream(queued=0, running=None, done=0, last=0, paused=None) -> dict:
    return {"queued": queued, "running": running, "done": done, "last": last, "paused": paused}


def _worker(alive=True, streams=None, **kw) -> dict:
    w = {
        "pid": 100,
        "host": "h",
        "alive": alive,
        "exit": None if alive else "killed by signal SIGKILL",
        "rss": 300 * 2**20,
        "cpu": 12.34,
        "gpu": None,
        "heartbeat_age": 0.3,
        "streams": streams or {"default": _stream()},
    }
    w.update(kw)
    return w


def _status(ranks: dict, errors=(), debugger=()) -> dict:
    return {
        "name": "m",
        "dims": {"dp": len(ranks)},
        "backend": "gloo",
        "generation": 3,
        "ranks": ranks,
        "errors": list(errors),
        "debugger": list(debugger),
        "bad_messages": 0,
    }


def _error(ident, ranks, t, kind="ValueError", msg="bad", tb="Traceback ...\nValueError: bad"):
    return {
        "ident": ident,
        "ranks": ranks,
        "type": kind,
        "message": msg,
        "traceback": tb,
        "stream": "default",
        "time": t,
    }


def _text(page: str) -> str:
    """What the HTML shows: tags dropped, entities decoded."""
    return html.unescape(re.sub(r"<[^>]+>", "", page))


def _cells(page: str) -> dict:
    """(rank, stream) -> state class of each queue cell."""
    found = re.findall(r"mnb-cell mnb-(\w+)' data-rank='(\d+)' data-stream='([^']+)'", page)
    return {(int(r), s): state for state, r, s in found}


# ------------------------------------------------------------------ drawing


@pytest.mark.unit
def test_queue_cells_are_coloured_by_state():
    running = {
        "ident": 9,
        "what": "%%monarch In[4]: train(model, loader, epochs=10)",
        "elapsed": 3.7,
    }
    st = _status(
        {
            0: _worker(
                streams={
                    "default": _stream(queued=2, running=running, done=5, last=8),
                    "comm": _stream(paused={"file": "<monarch In[5]>", "line": 3}, last=4),
                }
            ),
            1: _worker(streams={"default": _stream(done=6, last=12), "comm": _stream(last=4)}),
            2: _worker(alive=False, streams={"default": _stream(last=3), "comm": _stream(last=4)}),
        },
        errors=[_error(11, [1], 10.0)],  # rank 1's cell failed (its result fetch is ident 12)
    )
    page = render.main_html(st)
    assert _cells(page) == {
        (0, "default"): "busy",
        (0, "comm"): "paused",
        (1, "default"): "failed",
        (1, "comm"): "idle",
        (2, "default"): "dead",
        (2, "comm"): "dead",
    }
    text = _text(page)
    assert "▶ %%monarch In[4]: train(model, loade… · 3 s" in text
    assert "2 queued" in text and "5 done" in text
    assert "paused at <monarch In[5]>:3" in text
    assert "generation 3" in text and "2/3 workers alive" in text
    assert "killed by signal SIGKILL" in text and "300 MB" in text and "12%" in text
    # a later command finished on rank 1: the failure is history, the cell is idle again
    st["ranks"][1]["streams"]["default"]["last"] = 14
    assert _cells(render.main_html(st))[(1, "default")] == "idle"


@pytest.mark.unit
def test_heartbeat_turns_red_when_a_worker_stops_answering():
    st = _status({0: _worker(), 1: _worker(heartbeat_age=render.HEARTBEAT_STALE + 2.5)})
    health = render.health_html(st)
    beats = re.findall(r"<span class='mnb-beat( mnb-stale)?'[^>]*>([^<]*)</span>", health)
    assert beats == [("", "&lt;2 s"), (" mnb-stale", "7 s")]
    assert "color:#c00" in health.split("mnb-stale")[1][:40]
    # GPU columns only where NVML reported something
    assert "GPU" not in health
    st["ranks"][0]["gpu"] = {"mem": 3 * 2**30, "util": 87.0}
    health = render.health_html(st)
    assert "GPU mem" in health and "3.0 GB" in health and "87%" in health


@pytest.mark.unit
def test_errors_grouped_by_traceback_newest_first_and_expandable():
    tb_a = 'Traceback (most recent call last):\n  File "<x>", line 1\nValueError: bad'
    tb_b = "Traceback (most recent call last):\n  File \"<y>\", line 2\nKeyError: 'k'"
    st = _status(
        {r: _worker() for r in range(4)},
        errors=[
            _error(20, [0, 1, 2], 30.0, tb=tb_a),
            _error(15, [3], 20.0, kind="KeyError", msg="'k'", tb=tb_b),
            _error(10, [0, 1], 10.0, tb=tb_a),  # the same traceback, an older command
        ],
    )
    groups = render.group_errors(st["errors"])
    assert [(g["type"], g["ranks"], g["count"], g["commands"]) for g in groups] == [
        ("ValueError", [0, 1, 2], 5, 2),
        ("KeyError", [3], 1, 1),
    ]
    page = render.errors_html(st)
    assert page.count("<details") == 2 and "2 distinct" in page
    text = _text(page)
    assert text.index("ValueError") < text.index("KeyError")
    assert "ranks 0-2 · 5 failures in 2 commands" in text and "rank 3 · 1 failure" in text
    assert 'File "<y>", line 2' in text  # the traceback, inside <details>
    assert render.errors_html(_status({0: _worker()})).count("<details") == 0


@pytest.mark.unit
def test_status_line_and_session_labels():
    st = _status({0: _worker(pid=11), 1: _worker(pid=12)})
    assert render.status_text(st) == "mesh 'm': dp=2, gloo, 2/2 alive (pids 11, 12)"
    assert render.status_text(st, "broken").endswith("2/2 alive, broken (pids 11, 12)")
    assert render.mesh_state(st, usable=False, closed=True) == "shut down"
    assert render.mesh_state(st, usable=False, closed=False) == "broken"
    s = {"rank": 1, "stream": "side", "file": "<monarch In[3]>", "line": 4, "function": "f"}
    assert render.session_label(s) == "rank 1 · side · <monarch In[3]>:4 f"
    assert render.fold({0: "5\n", 1: "5\n", 2: "7\n"}) == "[ranks 0-1] 5\n[rank 2] 7"


@pytest.mark.unit
def test_waiting_cells_are_rewritten_into_awaited_calls():
    out = waiting.transform(["%%monarch --ranks 1\n", "x = 1\n", "x\n"])
    assert out == [
        "await get_ipython().find_cell_magic('monarch').__self__"
        ".monarch_awaited('--ranks 1', 'x = 1\\nx\\n')\n"
    ]
    compile(out[0], "<cell>", "exec", flags=__import__("ast").PyCF_ALLOW_TOP_LEVEL_AWAIT)
    for untouched in (
        ["%%monarch --noblock\n", "x\n"],
        ["%%monarch -h\n"],
        ["%%monarchy\n", "x\n"],
        ["%%time\n", "x\n"],
        ["x = 1\n"],
        ["%%monarch --ranks '0\n", "x\n"],  # bad quoting: the magic reports it
    ):
        assert waiting.transform(untouched) == untouched


# ------------------------------------------------------------------ on real workers


@pytest.fixture(scope="module")
def mesh2():
    m = mnb.local_mesh(dp=2)
    yield m
    m.shutdown()


def test_dashboard_follows_queues_errors_and_the_debugger(mesh2):
    d = Dashboard(mesh2, live=False)
    try:
        side = mesh2.stream("side")
        mesh2.exec("import time\ntime.sleep(30)", stream=side)

        def shows(part: str, text: str) -> bool:
            d.redraw()
            return text in html.unescape(getattr(d, part).value)

        # the side stream shows its running command (the worker reports when it starts)
        wait_for(
            lambda: shows("main", "▶ exec: import time"),
            30,
            "the running command",
            show=lambda: d.main.value,
        )
        # the interrupt lands once the command is in its sleep: send it until it did
        wait_for(
            lambda: mesh2.interrupt() or shows("errors", "KeyboardInterrupt"),
            30,
            "the interrupt to land",
            0.1,
            show=lambda: d.errors.value,
        )
        mesh2.exec("y = 1 / rank")  # rank 0 fails
        with pytest.raises(mnb.RemoteError):
            mesh2.wait(timeout=60)
        d.redraw()
        errors = _text(d.errors.value)
        assert "ZeroDivisionError: division by zero — rank 0 · 1 failure" in errors
        assert "KeyboardInterrupt" in errors and "stream side" in errors
        # a breakpoint on rank 1's default stream: the panel lists it and serves it
        mesh2.slice(dp=1).exec("x = 40 + rank\nbreakpoint()\nz = x")
        assert mesh2.debugger.wait_any(30)
        d.redraw()
        assert "1 paused session" in d.sessions.value
        assert d.command_row.layout.display == "flex"
        assert d.select.value == (1, "default")
        d.submit("p x").result(timeout=60)
        assert "(Pdb r1) p x\n41\n" in d.log
        d.submit("p nothing_here", target=(1, "default")).result(timeout=60)
        assert "NameError" in d.log
        d.submit("p 1", target=(0, "default")).result(timeout=60)
        assert "no paused session on rank 0 (default)" in d.log
        d.submit("c").result(timeout=60)
        assert "(rank 1 went on)" in d.log
        d.redraw()
        assert "no paused sessions" in d.sessions.value
        assert d.command_row.layout.display == "none"
    finally:
        d.close()
    assert d not in LOOP.dashboards()


@pytest.mark.unit
def test_a_view_collected_while_the_loop_holds_its_lock_does_not_deadlock():
    """CI hung 300 s: the collector ran an old dashboard's __del__ (close -> remove)
    on a thread inside the loop's lock, at an allocation there."""
    import gc
    import threading

    from monarch_nb.ui.redraw import RedrawLoop

    loop = RedrawLoop()

    class View:
        def __init__(self):
            self.cycle = self  # only the collector frees it

        def redraw(self, snapshots) -> None:
            pass

        def __del__(self):
            loop.remove(self)

    def collect_inside_the_lock() -> None:
        View()
        with loop._lock:
            gc.collect()

    t = threading.Thread(target=collect_inside_the_lock, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "the finalizer deadlocked on the loop's lock"


def test_redraw_loop_bounds_the_rate_and_stops_when_shut_down():
    with mnb.local_mesh(dp=1) as mesh:
        d = mesh.dashboard()
        assert d.live and d in LOOP.dashboards(mesh.key)
        f = mnb.remote(abs)
        passes = LOOP.passes
        t0 = time.monotonic()
        for _ in range(3):
            for _ in range(500):
                f(-1, mesh=mesh)
            mesh.wait()
        elapsed = time.monotonic() - t0
        # one pass per REDRAW_PERIOD at most (it sleeps that long before each pass)
        assert LOOP.passes - passes <= elapsed / LOOP.period + 1
        d.redraw()
        assert int(re.search(r"(\d+) done", d.main.value).group(1)) >= 1500
    # shut down: the last redraw says so, the controls are off, the loop lets it go
    wait_for(lambda: not d.live, 10, "the dashboard to stop")
    assert "shut down" in d.main.value and d.b_interrupt.disabled and d.input.disabled
    assert d not in LOOP.dashboards()


def test_heartbeat_of_a_stopped_worker_turns_red(mesh2):
    import os
    import signal

    d = Dashboard(mesh2, live=False)

    def stale() -> bool:
        d.redraw()
        return "mnb-stale" in d.main.value

    pid = mesh2.status()["ranks"][1]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(stale, 30, "a red beat", 0.2, lambda: d.main.value)
        beats = re.findall(r"class='mnb-beat( mnb-stale)?'[^>]*>([^<]*)<", d.main.value)
        assert beats[0] == ("", "&lt;2 s") and beats[1][0] == " mnb-stale"
        assert int(beats[1][1].split()[0]) >= render.HEARTBEAT_STALE
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(lambda: not stale(), 30, "it to answer", 0.2, lambda: d.main.value)
    d.close()
