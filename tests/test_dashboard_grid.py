"""The dashboard at scale: the heat grid of hosts x ranks on simulated meshes (light
ranks, one process per simulated host), the drill-down to one rank, small meshes
keeping the table, and the folding of outputs and the Lab summary at 1,024 ranks."""

from __future__ import annotations

import re

import pytest
from browser_helpers import Lab, missing
from wait_helpers import wait_for

import monarch_nb as mnb
from monarch_nb.controller import fold_by_rank, format_ranks
from monarch_nb.ui import Dashboard, grid, render


def _fail():
    raise ValueError("rank 77 says no")


def _noop():
    return None


@pytest.fixture(scope="module")
def mesh256():
    m = mnb.local_mesh(host=8, gpu=32, simulate=True, name="grid256")
    try:
        yield m
    finally:
        m.shutdown()


def _hosts(html: str) -> list[tuple[str, list[str]]]:
    """(host, the states of its cells) per grid row."""
    rows = re.findall(r"<tr class='mnb-grid-host' data-host='([^']*)'>(.*?)</tr>", html)
    return [(h, re.findall(r"<i class=g-(\w+) title='\d+ ", body)) for h, body in rows]


def _row(html: str, host: str) -> str:
    return re.search(rf"<tr class='mnb-grid-host' data-host='{host}'>(.*?)</tr>", html).group(1)


def test_grid_shows_hosts_by_ranks(mesh256):
    status = mesh256.status()
    assert grid.use_grid(status)
    html = grid.main_html(status, "ok")
    hosts = _hosts(html)
    assert [h for h, _ in hosts] == [f"sim-{i}" for i in range(8)]
    assert all(len(cells) == 32 for _, cells in hosts)
    assert all(set(cells) == {"idle"} for _, cells in hosts), hosts
    ranks = [int(r) for r in re.findall(r"<i class=g-\w+ title='(\d+) ", html)]
    assert ranks == list(range(256))
    assert "32/32 alive" in _row(html, "sim-3")
    assert "mnb-queues" not in html  # no per-rank table at this size


def test_failed_rank_marked_and_counted(mesh256):
    with pytest.raises(mnb.RemoteError):
        mnb.remote(_fail)(mesh=mesh256.slice(host=2, gpu=13)).fetch()  # rank 2 * 32 + 13
    mesh256.wait()

    def drawn():
        html = grid.main_html(mesh256.status(), "ok")
        # rank 77 is the 14th rank of sim-2 (32 per host)
        return html if dict(_hosts(html))["sim-2"][77 - 64] == "failed" else None

    html = wait_for(drawn, 10, "rank 77's cell drawn failed")
    cells = dict(_hosts(html))
    assert cells["sim-2"].count("failed") == 1
    assert "1 failed" in _row(html, "sim-2")
    assert all("failed" not in c for h, c in cells.items() if h != "sim-2")
    assert "mnb-g-fails" not in _row(html, "sim-1")
    # a later command that succeeds there clears it
    mnb.remote(_noop)(mesh=mesh256).fetch()
    mnb.remote(_noop)(mesh=mesh256).fetch()
    mesh256.wait()
    wait_for(
        lambda: "failed" not in dict(_hosts(grid.main_html(mesh256.status(), "ok")))["sim-2"],
        10,
        "the failure cleared by later commands",
    )


def test_dashboard_draws_grid_and_drills_down(mesh256):
    d = Dashboard(mesh256, live=False)
    try:
        bundle = d._repr_mimebundle_()  # what a saved notebook keeps: the grid, one line
        assert "mnb-grid-host" in bundle["text/html"] and "mnb-queues" not in bundle["text/html"]
        assert bundle["text/plain"].endswith("256/256 alive (8 hosts, 8 processes)")
        assert "mnb-grid-host" in d.main.value
        assert d.grid.layout.display == "flex" and d.children[1] is d.grid
        assert d.grid.detail.value == ""
        d.grid.show_rank(77)  # the Text's Enter: the detail redraws at once
        detail = d.grid.detail.value
        assert "<b>rank 77</b> (sim-2)" in detail
        assert re.findall(r"data-rank='(\d+)'", detail) == ["77"]
        assert "mnb-health" in detail and "<td>77</td>" in detail
        d.grid.show_rank("abc")
        assert "not a rank number: &#x27;abc&#x27;" in d.grid.detail.value
        d.grid.show_rank(9999)
        assert "no rank 9999 (ranks 0-255)" in d.grid.detail.value
        d.grid.show_rank(None)
        assert d.grid.detail.value == ""
        # the stream choice lists memory and the mesh's streams; one draws that stream only
        values = [v for _, v in d.grid.stream_select.options]
        assert values == [grid.ALL, grid.MEMORY, "default"]
        d.grid.stream_select.value = "default"
        assert "stream default" in d.main.value
        d.grid.stream_select.value = grid.MEMORY  # light ranks report their RSS
        assert "most memory" in d.main.value and "class=g-m" in d.main.value
        # the mesh keeps working under a drilled-down dashboard
        mnb.remote(_noop)(mesh=mesh256).fetch()
    finally:
        d.close()


def test_grid_updates_only_when_something_changed(mesh256):
    d = Dashboard(mesh256, live=False)
    try:
        wait_for(lambda: _same_twice(d), 10, "a redraw that sends no update (nothing changed)")
    finally:
        d.close()


def _same_twice(d) -> bool:
    before = d.redraws
    d.redraw()
    return d.redraws == before


def test_small_mesh_keeps_the_table():
    m = mnb.local_mesh(host=1, gpu=2, simulate=True, name="grid-small")
    try:
        d = Dashboard(m, live=False)
        try:
            assert not grid.use_grid(m.status())
            assert "mnb-queues" in d.main.value and "mnb-health" in d.main.value
            assert "mnb-grid" not in d.main.value
            assert d.grid.layout.display == "none" and d.grid not in d.children
        finally:
            d.close()
    finally:
        m.shutdown()


def _w(host, alive=True, queued=0, running=None, unresponsive=False, paused=None):
    s = {"queued": queued, "running": running, "done": 0, "last": 0, "paused": paused}
    return {"host": host, "alive": alive, "unresponsive": unresponsive, "streams": {"default": s}}


def test_cell_states_and_host_summary_pure():
    run = {"ident": 1, "what": "f", "elapsed": 1.0}
    ranks = {
        0: _w("a"),
        1: _w("a", running=run),
        2: _w("a", queued=2),
        3: _w("a", queued=20),
        4: _w("b", alive=False),
        5: _w("b", unresponsive=True),
        6: _w("b", paused={"file": "x.py", "line": 1, "function": "f"}),
        7: _w("b", queued=7),
    }
    status = {"dims": {"host": 2, "gpu": 4}, "ranks": ranks, "errors": []}
    html = grid.grid_html(status)
    cells = dict(_hosts(html))
    assert cells == {
        "a": ["idle", "run", "q1", "q3"],
        "b": ["dead", "unresponsive", "paused", "q2"],
    }
    assert "busiest queue 20 (rank 3)" in _row(html, "a")
    assert "3/4 alive" in _row(html, "b")
    assert "<i class=g-q3 title='3 queued 16+, 20 queued'></i>" in html


def test_memory_colours_each_rank_by_its_share_of_the_largest_pure():
    ranks = {r: {**_w("a" if r < 4 else "b"), "rss": (r + 1) * 100 << 20} for r in range(8)}
    ranks[3]["gpu"] = {"allocated": 2000 << 20, "reserved": 2048 << 20, "peak": 2100 << 20}
    ranks[7] = _w("b", alive=False)
    status = {"dims": {"host": 2, "gpu": 4}, "ranks": ranks, "errors": []}
    html = grid.grid_html(status, grid.MEMORY)
    cells = dict(_hosts(html))
    # the largest is rank 3's GPU (2000 MB): 100-300 MB of RSS is under 20 %, 500-700 MB 20-50 %
    assert cells == {"a": ["m1", "m1", "m1", "m5"], "b": ["m2", "m2", "m2", "dead"]}
    assert "most memory 2,000 MB (rank 3)" in _row(html, "a")
    assert "memory (GPU allocated, else RSS)" in html and "queued 1-3" not in html
    health = render.health_html({"ranks": {3: {**ranks[3], "pid": 1, "cpu": 1.0}}})
    assert "allocated / reserved (peak)" in health and "2.0 GB / 2.0 GB (2.1 GB)" in health


def test_one_host_rows_follow_the_last_dim():
    ranks = {r: _w("node1") for r in range(64)}
    status = {"dims": {"dp": 4, "tp": 16}, "ranks": ranks, "errors": []}
    rows = grid.host_rows(status)
    assert [h for h, _ in rows] == ["node1:0", "node1:1", "node1:2", "node1:3"]
    assert all(len(rs) == 16 for _, rs in rows)


def test_outputs_fold_at_1024_ranks():
    ranks = [r for r in range(1024) if r != 512]
    assert format_ranks(ranks) == "ranks 0-511,513-1023"
    outputs = {r: "hello\n" for r in range(1024)}
    outputs[512] = "odd one\n"
    assert fold_by_rank(outputs) == "[ranks 0-511,513-1023] hello\n[rank 512] odd one"


def test_lab_summary_stays_small_at_1024():
    ranks = {r: _w(f"sim-{r // 32}", running={"ident": 1, "what": "f", "elapsed": 0}) for r in
             range(1024)}  # fmt: skip
    for w in ranks.values():
        w.update(exit=None, pid=1)
    status = {"name": "m", "dims": {"host": 32, "gpu": 32}, "backend": "simulated",
              "ranks": ranks, "errors": [], "debugger": []}  # fmt: skip
    s = render.summary(status)
    assert s["total"] == 1024 and s["alive"] == 1024
    assert s["busy_ranks"] == "ranks 0-1023"  # what the Lab status item shows past 4 ranks
    for r in range(32, 64):
        ranks[r].update(alive=False, exit="killed by signal SIGKILL")
    s = render.summary(status)
    assert len(s["dead"]) == 32  # the tooltip's lines past 4 dead ranks: one per reason
    assert s["dead_folded"] == {"killed by signal SIGKILL": "ranks 32-63"}


@pytest.mark.browser
@pytest.mark.skipif(missing() is not None, reason=missing() or "")  # before its fixtures
def test_grid_in_jupyterlab(page, server):
    lab = Lab(
        server,
        page,
        "dashboard-grid",
        [
            "import monarch_nb as mnb\n"
            "m = mnb.local_mesh(host=8, gpu=32, simulate=True, name='grid')\n"
            "m.dashboard()",
            "def bad():\n    raise ValueError('no')\n"
            "try:\n    mnb.remote(bad)(mesh=m.slice(host=2, gpu=13)).fetch()\n"
            "except mnb.RemoteError:\n    pass",
        ],
    )
    lab.open()
    lab.run_all()
    grid_rows = page.locator(".mnb-dashboard tr.mnb-grid-host")
    page.wait_for_function(
        "() => document.querySelectorAll('.mnb-dashboard tr.mnb-grid-host').length === 8",
        timeout=60_000,
    )
    assert grid_rows.nth(0).locator("td.mnb-g-cells i").count() == 32
    failed = page.locator(".mnb-dashboard i.g-failed[title^='77 ']")
    failed.wait_for(timeout=60_000)
    assert failed.is_visible()
    assert "1 failed" in grid_rows.nth(2).inner_text()
    box = page.locator(".mnb-dashboard .mnb-grid-rank input")
    box.fill("77")
    box.press("Enter")
    detail = page.locator(".mnb-dashboard .mnb-grid-detail")
    page.wait_for_function(
        "() => /rank 77/.test(document.querySelector('.mnb-dashboard .mnb-grid-detail')"
        "?.innerText || '')",
        timeout=60_000,
    )
    assert "sim-2" in detail.inner_text()
    lab.shot("dashboard-grid", ".mnb-dashboard")
    lab.add_cell("m.shutdown()")
    lab.run_cell(2)


def test_cell_lines_and_errors_fold_at_1024_ranks():
    from monarch_nb.controller import RemoteError
    from monarch_nb.notebook.live import fold_rows

    rows = {r: "step 3 done" for r in range(1024)}
    rows[512] = "step 2 done"
    assert fold_rows(rows) == ["[ranks 0-511,513-1023] step 3 done", "[rank 512] step 2 done"]
    tb = "Traceback (most recent call last):\nValueError: bad"
    failures = {r: ("ValueError", "bad", tb) for r in range(1024) if r != 512}
    text = str(RemoteError(failures, ident=7, context="f failed"))
    assert "--- ranks 0-511,513-1023 ---" in text
    assert text.count("ValueError: bad") == 1 and len(text) < 500
