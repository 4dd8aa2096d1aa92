"""Kernel tier: gutter breakpoints on ``%%monarch`` cells (and notebook functions that run
remotely) reach every rank of the mesh; pause, sources, several meshes and bad input.
A real kernel, real debugpy, a dp=2 mesh; DAP over jupyter_client's control channel."""

from __future__ import annotations

import json

import pytest
from dap_helpers import start, stopped
from kernel_helpers import mesh_kernel

from monarch_nb.notebook.dap import THREAD_BASE

pytestmark = pytest.mark.kernel


@pytest.fixture(scope="module")
def k(tmp_path_factory):
    with mesh_kernel(tmp_path_factory.mktemp("dapbp")) as kern:
        yield kern


@pytest.fixture(scope="module")
def dap(k):
    d = start(k)
    d.ok("configurationDone")
    yield d
    d.request("disconnect", restart=False, terminateDebuggee=False)


@pytest.fixture(autouse=True)
def fresh(dap):
    """Each test starts with no remote thread and no old event (a failed one leaves none)."""
    dap.events.clear()
    yield
    for t in dap.ok("threads")["threads"]:
        if t["id"] >= THREAD_BASE:
            dap.request("continue", threadId=t["id"])


def remote_stops(dap, n: int, reason: str | None = None) -> dict:
    """rank -> thread id of the next ``n`` stopped events on remote threads."""
    tids = {}
    for _ in range(n):
        ev = dap.wait_event(
            lambda ev: (
                ev["event"] == "stopped"
                and ev["body"]["threadId"] >= THREAD_BASE
                and not ev["body"]["description"].endswith("still paused")  # shown again
                and (reason is None or ev["body"]["reason"] == reason)
            )
        )
        tids[int(ev["body"]["description"].split(" ")[1])] = ev["body"]["threadId"]
    return tids


def top(dap, tid) -> dict:
    return dap.ok("stackTrace", threadId=tid)["stackFrames"][0]


def local_vars(dap, frame_id) -> dict:
    scopes = dap.ok("scopes", frameId=frame_id)["scopes"]
    got = dap.ok("variables", variablesReference=scopes[0]["variablesReference"])
    return {v["name"]: v for v in got["variables"]}


def continue_all(dap, tids) -> None:
    for t in tids:
        dap.ok("continue", threadId=t)
        dap.wait_event(lambda ev, t=t: ev["event"] == "thread" and ev["body"]["threadId"] == t)


def results(k, dap, name: str) -> list:
    return k.value(
        f"[r['data']['text/plain'] for r in {name}.result(timeout=30)]", output_hook=dap.hook
    )


CELL = """%%monarch --noblock -o bp
x = rank * 10
# a comment: no code here
y = x + 1
z = y * 2
z"""


def test_a_gutter_breakpoint_stops_every_rank_of_the_cells_mesh(k, dap):
    path = dap.ok("dumpCell", code=CELL)["sourcePath"]
    wanted = [{"line": 4}, {"line": 3}, {"line": 1}, {"line": 99}]
    got = dap.ok("setBreakpoints", source={"path": path}, breakpoints=wanted)["breakpoints"]
    assert [b["verified"] for b in got] == [True, False, False, False]
    assert got[0]["line"] == 4 and got[0]["source"]["path"] == path
    assert "no code on line 3" in got[1]["message"]
    assert "%%monarch line" in got[2]["message"]
    assert "no code on line 99" in got[3]["message"]
    # JupyterLab restores its gutter from debugInfo
    info = dap.ok("debugInfo")["breakpoints"]
    assert {"source": path, "breakpoints": [{"line": 4}]} in info

    k.ok(CELL, output_hook=dap.hook)
    tids = remote_stops(dap, 2, "breakpoint")
    assert sorted(tids) == [0, 1]
    frame = top(dap, tids[1])
    assert (frame["line"], frame["source"]["path"]) == (4, path)
    assert dap.ok("source", source={"path": path})["content"] == CELL
    seen = local_vars(dap, frame["id"])
    assert seen["x"]["value"] == "10" and "y" not in seen  # stopped before line 4 ran
    dap.ok("next", threadId=tids[1])
    dap.wait_event(stopped(tids[1], "step"))
    assert top(dap, tids[1])["line"] == 5
    # while a rank is shown, the kernel's globals are not (JupyterLab would show them)
    assert dap.request("inspectVariables")["success"] is False
    # JupyterLab's continue button sends thread 1 (it forgot the thread it showed):
    # with the kernel not stopped in debugpy, that is the rank shown last (stepped)
    dap.ok("continue", threadId=1)
    dap.wait_event(lambda ev: ev["event"] == "thread" and ev["body"]["threadId"] == tids[1])
    again = dap.wait_event(stopped(tids[0]))  # the other paused rank, shown next
    assert again["body"]["description"] == "rank 0 · default still paused"
    dap.ok("continue", threadId=1)
    dap.wait_event(lambda ev: ev["event"] == "thread" and ev["body"]["threadId"] == tids[0])
    assert results(k, dap, "bp") == ["2", "22"]

    # removed from the gutter: the cell runs through
    assert dap.ok("setBreakpoints", source={"path": path}, breakpoints=[]) == {"breakpoints": []}
    k.ok(CELL, output_hook=dap.hook)
    assert results(k, dap, "bp") == ["2", "22"]
    assert not [t for t in dap.ok("threads")["threads"] if t["id"] >= THREAD_BASE]


COND = """%%monarch --noblock -o cond
total = 0
for i in range(5):
    total += i * rank
total"""


def test_a_conditional_breakpoint_stops_where_it_holds(k, dap):
    path = dap.ok("dumpCell", code=COND)["sourcePath"]
    bps = [{"line": 4, "condition": "rank == 1 and i == 3"}]
    assert dap.ok("setBreakpoints", source={"path": path}, breakpoints=bps)["breakpoints"][0][
        "verified"
    ]
    try:
        k.ok(COND, output_hook=dap.hook)
        tids = remote_stops(dap, 1, "breakpoint")
        assert list(tids) == [1]  # rank 0 never meets the condition
        frame = top(dap, tids[1])
        assert dap.ok("evaluate", expression="(i, total)", frameId=frame["id"])["result"] == (
            "(3, 3)"
        )
        continue_all(dap, tids.values())
        assert results(k, dap, "cond") == ["0", "10"]
    finally:
        dap.request("setBreakpoints", source={"path": path}, breakpoints=[])


FUNC = """def scaled(v):
    w = v * 7
    return w
"""


def test_a_breakpoint_in_a_notebook_function_that_runs_remotely(k, dap):
    path = dap.ok("dumpCell", code=FUNC)["sourcePath"]
    got = dap.ok("setBreakpoints", source={"path": path}, breakpoints=[{"line": 3}])
    assert got["breakpoints"][0]["verified"]  # debugpy's answer: the kernel's own too
    try:
        k.ok(FUNC, output_hook=dap.hook)
        k.ok("fr = mnb.remote(scaled)(6)", output_hook=dap.hook)
        tids = remote_stops(dap, 2, "breakpoint")
        frame = top(dap, tids[0])
        assert (frame["name"], frame["line"], frame["source"]["path"]) == (
            "scaled · rank 0",
            3,
            path,
        )
        assert local_vars(dap, frame["id"])["w"]["value"] == "42"
        continue_all(dap, tids.values())
        assert k.value("fr.fetch(timeout=30)", output_hook=dap.hook) == [42, 42]
    finally:
        dap.request("setBreakpoints", source={"path": path}, breakpoints=[])


LOOP = """%%monarch --noblock -o looped
n = 0
import time
deadline = time.monotonic() + 60
while rank == 1 and n >= 0 and time.monotonic() < deadline:
    n += 1
    time.sleep(0.01)
n"""


def test_pause_stops_a_running_rank_at_its_next_line(k, dap):
    path = dap.ok("dumpCell", code=LOOP)["sourcePath"]
    bps = [{"line": 3, "condition": "rank == 1"}]
    dap.ok("setBreakpoints", source={"path": path}, breakpoints=bps)
    try:
        k.ok(LOOP, output_hook=dap.hook)
        tid = remote_stops(dap, 1, "breakpoint")[1]
        dap.ok("continue", threadId=tid)  # the loop runs, under the breakpoint's tracer
        assert dap.ok("pause", threadId=tid) == {}  # before or after the worker runs on
        dap.wait_event(stopped(tid, "pause"))
        frame = top(dap, tid)
        assert frame["line"] in (4, 5, 6, 7)  # the next line after the continue, or in the loop
        dap.ok("evaluate", expression="n = -1", frameId=frame["id"])  # the loop's end
        continue_all(dap, [tid])
        assert results(k, dap, "looped") == ["0", "-1"]
        gone = dap.request("pause", threadId=tid)  # its session is over
        assert gone["success"] is False
        assert f"thread id {tid} cannot be paused: its rank runs without" in gone["message"]
    finally:
        dap.request("setBreakpoints", source={"path": path}, breakpoints=[])


HUGE = """%%monarch --noblock -o huge
import os, importlib.util
big = list(range(10_000_000))
t = torch.empty(2**24)
gone = f"/tmp/mnb_dap_gone_{os.getpid()}.py"
with open(gone, "w") as fh:
    fh.write("def g():\\n    breakpoint()\\n    return 5\\n")
spec = importlib.util.spec_from_file_location("mnb_gone", gone)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
os.remove(gone)
mod.g() + len(big) - 10_000_000"""


def test_huge_values_and_a_missing_source_file_are_summarised_or_refused(k, dap):
    k.ok(HUGE, output_hook=dap.hook)
    tids = remote_stops(dap, 2)
    frames = dap.ok("stackTrace", threadId=tids[1])["stackFrames"]
    assert frames[0]["name"] == "g · rank 1"
    missing = frames[0]["source"]["path"]
    assert missing.startswith("/tmp/mnb_dap_gone_")
    rep = dap.request("source", source={"path": missing})
    assert rep["success"] is False
    assert rep["message"] == f"source of {missing} is not available on the kernel's host"
    cell = frames[1]
    seen = local_vars(dap, cell["id"])
    assert seen["big"]["value"].startswith("list(len=10000000) [0, 1, 2")
    assert seen["t"]["value"] == "tensor(shape=(16777216,), dtype=torch.float32, device=cpu)"
    page = dap.request("variables", variablesReference=seen["big"]["variablesReference"])
    assert len(page["body"]["variables"]) == 500  # one page, whatever the list's length
    assert len(json.dumps(page)) < 100_000
    continue_all(dap, tids.values())
    assert results(k, dap, "huge") == ["5", "5"]
    assert k.value("mnb.get_mesh().exec('rank * 3').fetch(timeout=20)") == [0, 3]


SIDE = """%%monarch --mesh side --noblock -o on_side
breakpoint()
rank"""


def test_two_meshes_name_their_threads_and_a_shut_down_mesh_refuses(k, dap):
    k.ok("side = mnb.local_mesh(dp=1, name='side')", timeout=120, output_hook=dap.hook)
    k.ok(
        "%%monarch --mesh default --noblock -o on_default\nbreakpoint()\nrank", output_hook=dap.hook
    )
    remote_stops(dap, 2)  # (events are read before the next cell: it would skip them)
    k.ok(SIDE, output_hook=dap.hook)
    remote_stops(dap, 1)
    names = sorted(t["name"] for t in dap.ok("threads")["threads"] if t["id"] >= THREAD_BASE)
    assert names == [
        "rank 0 · default · default",
        "rank 0 · default · side",
        "rank 1 · default · default",
    ]
    tids = [t["id"] for t in dap.ok("threads")["threads"] if t["id"] >= THREAD_BASE]
    continue_all(dap, tids)
    assert results(k, dap, "on_side") == ["0"]
    k.ok("side.shutdown()", output_hook=dap.hook)

    path = dap.ok("dumpCell", code=SIDE)["sourcePath"]
    got = dap.ok("setBreakpoints", source={"path": path}, breakpoints=[{"line": 3}])
    bp = got["breakpoints"][0]
    assert bp["verified"] is False
    assert "no mesh named 'side' is running" in bp["message"]
    dap.request("setBreakpoints", source={"path": path}, breakpoints=[])
    # the kernel and the other mesh keep working, and one mesh left: the short names
    assert results(k, dap, "on_default") == ["0", "1"]
    k.ok("%%monarch --mesh default --noblock -o again\nbreakpoint()\nrank", output_hook=dap.hook)
    tids = remote_stops(dap, 2)
    names = sorted(t["name"] for t in dap.ok("threads")["threads"] if t["id"] >= THREAD_BASE)
    assert names == ["rank 0 · default", "rank 1 · default"]
    continue_all(dap, tids.values())
    assert results(k, dap, "again") == ["0", "1"]


PLAIN = "def held():\n    x = 5\n    return x\n\nheld()"


def test_remote_threads_are_served_while_debugpy_holds_the_kernel(k, dap):
    """debugpy suspends the threads it traces when the kernel stops: monarch_nb's own
    (the controller's IO thread) keep running, and stay out of the thread list."""
    k.ok("%%monarch --noblock -o beside\nw = rank + 40\nbreakpoint()\nw", output_hook=dap.hook)
    tids = remote_stops(dap, 2)
    path = dap.ok("dumpCell", code=PLAIN)["sourcePath"]
    dap.ok("setBreakpoints", source={"path": path}, breakpoints=[{"line": 3}])
    msg_id = k.kc.execute(PLAIN)
    ev = dap.wait_event(
        lambda ev: ev["event"] == "stopped" and ev["body"]["threadId"] < THREAD_BASE
    )
    try:
        names = [t["name"] for t in dap.ok("threads")["threads"]]
        assert "rank 1 · default" in names
        assert not [n for n in names if n.startswith("monarch-")], names
        frame = top(dap, tids[1])
        assert dap.ok("evaluate", expression="w", frameId=frame["id"])["result"] == "41"
    finally:
        dap.request("setBreakpoints", source={"path": path}, breakpoints=[])
        dap.ok("continue", threadId=ev["body"]["threadId"])
    reply = k.kc.get_shell_msg(timeout=30)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = k.kc.get_shell_msg(timeout=30)
    assert reply["content"]["status"] == "ok"
    continue_all(dap, tids.values())
    assert results(k, dap, "beside") == ["40", "41"]


AFTER = "%%monarch --mesh default --noblock -o after_restart\nv = rank + 5\nv * 2"


def test_breakpoints_reach_the_fresh_workers_of_a_restarted_mesh(k, dap):
    path = dap.ok("dumpCell", code=AFTER)["sourcePath"]
    dap.ok("setBreakpoints", source={"path": path}, breakpoints=[{"line": 3}])
    try:
        k.ok("mnb.get_mesh('default').restart()", timeout=120, output_hook=dap.hook)
        k.ok(AFTER, output_hook=dap.hook)
        tids = remote_stops(dap, 2, "breakpoint")
        assert top(dap, tids[1])["line"] == 3
        continue_all(dap, tids.values())
        assert results(k, dap, "after_restart") == ["10", "12"]
    finally:
        dap.request("setBreakpoints", source={"path": path}, breakpoints=[])
