"""The dashboard's activity view (ui/task_stream.py): the task stream drawn from
mesh.timeline() (a pure function, unit), and the view on a real mesh: bars per
rank and stream, a straggler made by a sleep on one rank, stacks in one click."""

from __future__ import annotations

import re
import time

import pytest
from wait_helpers import wait_for

import monarch_nb as mnb
from monarch_nb.ui import Dashboard
from monarch_nb.ui.task_stream import running, stacks_html, task_stream_html


def _rec(rank, start, end, kind="call", name="f", stream="default", straggler=False, ident=1):
    return {"rank": rank, "stream": stream, "ident": ident, "kind": kind, "name": name,
            "start": start, "end": end, "straggler": straggler}  # fmt: skip


def _rows(svg: str) -> list[str]:
    return re.findall(r"<text x=\"0\" y=\"\d+\">([^<]+)</text>", svg)


@pytest.mark.unit
def test_a_row_per_rank_and_stream_bars_coloured_by_kind_and_the_straggler_outlined():
    now = 1000.0
    recs = [
        _rec(0, 995.0, 995.5, "cell", "cell In[3]"),
        _rec(1, 995.0, 997.0, "cell", "cell In[3]", straggler=True),
        _rec(0, 998.0, 998.1, "collective", "all_reduce", stream="comms"),
        _rec(1, 980.0, 981.0, "op", "aten.add"),  # before the window: not drawn
    ]
    svg = task_stream_html(recs, now, 10.0)
    assert _rows(svg) == ["rank 0 comms", "rank 0 default", "rank 1 default"]
    assert svg.count("mnb-ts-straggler") == 1 and "2000.0 ms" in svg
    assert "#4e79a7" in svg and "#f28e2b" in svg and "aten.add" not in svg
    assert "nothing ran in the last 2 s" in task_stream_html(recs, now + 20, 2.0)
    status = {"ranks": {0: {"streams": {"side": {"running": {"ident": 9, "what": "nap",
                                                              "elapsed": 4.0}}}}}}  # fmt: skip
    (run,) = running(status, now)
    assert (run["start"], run["end"], run["kind"]) == (996.0, now, "running")
    assert "nap (running)" in task_stream_html(recs + [run], now, 10.0)


@pytest.mark.unit
def test_a_thousand_ranks_fold_by_host_and_close_bars_merge():
    now = 100.0
    recs = [
        _rec(r, 90 + i * 0.001, 90 + i * 0.001 + 0.0005, "op", "aten.mul", ident=i)
        for r in range(1024) for i in range(10)
    ]  # fmt: skip
    hosts = {r: f"sim-{r // 32}" for r in range(1024)}  # as grid.host_rows names them
    svg = task_stream_html(recs, now, 10.0, hosts)
    rows = _rows(svg)
    assert len(rows) == 32 and rows[0] == "sim-0 default" and rows[-1] == "sim-31 default"
    assert svg.count("<rect") == 32 * 2  # a background and one merged bar per host row
    assert len(svg) < 20_000  # 10,240 commands drawn in a bounded page


@pytest.mark.unit
def test_stacks_show_running_streams_and_silent_ranks():
    out = stacks_html({
        0: {"default": {"running": "cell In[4]", "stack": "File x, line 3\n  time.sleep(60)"},
            "side": {"running": None, "stack": ""}},
        1: None,
    })  # fmt: skip
    assert "rank 0 default: cell In[4]" in out and "time.sleep(60)" in out
    assert "side" not in out and "rank 1</b>: no answer" in out
    assert "every stream is idle" in stacks_html({0: {"default": {"running": None, "stack": ""}}})


def _sleep_by_rank(seconds):
    time.sleep(seconds[mnb.current_rank()])


def test_the_activity_view_of_a_real_mesh_shows_the_straggler_and_stacks():
    mesh = mnb.local_mesh(dp=2, name="activity")
    dash = Dashboard(mesh, live=False)
    try:
        assert dash.activity.view.value == ""  # closed: the timeline is not read
        dash.activity.toggle.value = True
        for _ in range(3):
            mnb.remote(_sleep_by_rank)({0: 0.02, 1: 0.3}, mesh=mesh)
        mesh.wait()

        def drawn():
            dash.redraw()
            return "mnb-ts-straggler" in dash.activity.view.value

        wait_for(drawn, 30, "the straggler in the activity view")
        svg = dash.activity.view.value
        assert _rows(svg) == ["rank 0 default", "rank 1 default"]
        blocked = mnb.remote(_sleep_by_rank)({0: 30, 1: 30}, mesh=mesh)
        wait_for(lambda: mesh.status()["ranks"][0]["streams"]["default"]["running"], 30, "a run")
        dash.activity._click_stacks()
        wait_for(lambda: "time.sleep" in dash.activity.stacks.value, 30, "the stacks")
        assert "rank 1 default" in dash.activity.stacks.value
        mesh.interrupt()
        with pytest.raises(mnb.RemoteError):
            blocked.fetch(rank=0)
    finally:
        dash.close()
        mesh.shutdown()
