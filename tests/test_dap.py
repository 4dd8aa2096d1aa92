"""Kernel tier: JupyterLab's debugger protocol (DAP over the control channel) reaches the
paused pdb sessions of the workers as threads of the kernel (notebook/dap.py). A real
kernel, real debugpy, a dp=2 mesh; no front end but jupyter_client."""

from __future__ import annotations

import queue
import time

import psutil
import pytest
from dap_helpers import start, stopped
from kernel_helpers import mesh_kernel

import monarch_nb as mnb
from monarch_nb.notebook.dap import REF_BASE, THREAD_BASE

pytestmark = pytest.mark.kernel

CELL = """%%monarch --noblock -o held
import torch
x = rank * 10
t = torch.zeros(3, 4)
breakpoint()
y = x + 1
z = y * 2
y"""


@pytest.fixture(scope="module")
def k(tmp_path_factory):
    with mesh_kernel(tmp_path_factory.mktemp("dap")) as kern:
        yield kern


def test_structured_requests_are_bounded_and_refuse_bad_input(mesh):
    """The worker half, driven through the controller (DebugSessions.inspect): paging of
    a 10-million-item list, the cap per reply, and clear errors for bad requests."""
    dbg = mesh.debugger
    side = mesh.stream("dap-side")
    r = mnb.remote(_paused_with_a_big_list)(mesh=mesh.slice(dp=1), stream=side)
    try:
        assert dbg.wait_any(20)
        s = dbg.find(1)
        frames = dbg.inspect(s, "stack", {})["frames"]
        assert frames[0]["name"] == "_paused_with_a_big_list"
        local = dbg.inspect(s, "scopes", {"frame": frames[0]["index"]})["scopes"][0]
        kids = dbg.inspect(s, "variables", {"ref": local["variablesReference"]})["variables"]
        big = next(v for v in kids if v["name"] == "big")
        assert big["value"].startswith("list(len=10000000) [0, 1") and len(big["value"]) <= 300
        page = dbg.inspect(s, "variables", {"ref": big["variablesReference"], "start": 5000})
        assert [v["name"] for v in page["variables"][:2]] == ["5000", "5001"]
        assert len(page["variables"]) == 500  # the cap, whatever was asked
        many = {"ref": big["variablesReference"], "count": 10**9}
        assert len(dbg.inspect(s, "variables", many)["variables"]) == 500
        with pytest.raises(ValueError, match="no variable reference 999"):
            dbg.inspect(s, "variables", {"ref": 999})
        with pytest.raises(ValueError, match="no frame 42"):
            dbg.inspect(s, "scopes", {"frame": 42})
        with pytest.raises(ValueError, match="unknown debugger request 'launch'"):
            dbg.inspect(s, "launch", {})
        # the session still serves lines, and the mesh commands
        assert "10000000" in dbg.run(1, "p len(big)")
        assert mesh.exec("rank").fetch(timeout=20) == [0, 1]
    finally:
        dbg.continue_all()
    assert r.fetch(rank=1, timeout=20) == 10_000_000
    with pytest.raises(LookupError, match="not paused"):
        dbg.inspect(s, "stack", {})


def _paused_with_a_big_list():
    big = list(range(10_000_000))
    breakpoint()
    return len(big)


@pytest.fixture(scope="module")
def dap(k):
    """One debugger session for the module, as a JupyterLab tab keeps one."""
    d = start(k)
    d.ok("configurationDone")
    yield d
    d.request("disconnect", restart=False, terminateDebuggee=False)


def test_paused_ranks_are_threads_of_the_kernels_debugger(k, dap):
    _drive(k, dap)


def test_the_kernels_own_breakpoints_still_go_to_debugpy(k, dap):
    """A breakpoint in a plain cell stops the kernel (debugpy), as without monarch_nb."""
    code = "def f(a, b):\n    c = a + b\n    return c\n\nf(2, 3)"
    path = dap.ok("dumpCell", code=code)["sourcePath"]
    try:
        dap.ok("setBreakpoints", breakpoints=[{"line": 2}], source={"path": path})
        msg_id = k.kc.execute(code)
        ev = dap.wait_event(
            lambda ev: ev["event"] == "stopped" and ev["body"]["threadId"] < THREAD_BASE
        )
        tid = ev["body"]["threadId"]
        assert tid < THREAD_BASE
        frame = dap.ok("stackTrace", threadId=tid)["stackFrames"][0]
        assert frame["line"] == 2 and frame["source"]["path"] == path
        scopes = dap.ok("scopes", frameId=frame["id"])["scopes"]
        local = dap.ok("variables", variablesReference=scopes[0]["variablesReference"])
        assert {v["name"]: v["value"] for v in local["variables"]}["a"] == "2"
        dap.ok("continue", threadId=tid)
        deadline = time.monotonic() + 30
        while True:
            assert time.monotonic() < deadline, "the debugged cell did not finish"
            try:
                reply = k.kc.get_shell_msg(timeout=1.0)
            except queue.Empty:
                continue
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        assert reply["content"]["status"] == "ok"
    finally:
        dap.request("setBreakpoints", breakpoints=[], source={"path": path})


def _drive(k, dap):
    k.ok(CELL, output_hook=dap.hook)
    # both ranks pause; the kernel says so with a stopped event per thread
    threads = {}
    for rank in (0, 1):
        ev = dap.wait_event(
            lambda ev, rank=rank: (
                ev["event"] == "stopped" and f"rank {rank} " in ev["body"].get("description", "")
            )
        )
        threads[rank] = ev["body"]["threadId"]
        assert ev["body"]["reason"] == "breakpoint"
    listed = dap.ok("threads")["threads"]
    names = {t["id"]: t["name"] for t in listed}
    assert names[threads[0]] == "rank 0 · default" and names[threads[1]] == "rank 1 · default"
    assert all(tid >= THREAD_BASE for tid in threads.values())
    assert any(t["id"] < THREAD_BASE for t in listed), "the kernel's own threads are kept"

    tid = threads[1]
    frames = dap.ok("stackTrace", threadId=tid)["stackFrames"]
    top = frames[0]
    # the frame names the file JupyterLab knows the cell by (dumpCell), at the cell's line
    cell_file = dap.ok("dumpCell", code=CELL)["sourcePath"]
    assert top["source"]["path"] == cell_file and top["line"] == 6
    assert dap.ok("source", source={"path": cell_file})["content"] == CELL
    assert top["id"] >= REF_BASE
    scopes = dap.ok("scopes", frameId=top["id"])["scopes"]
    assert [s["name"] for s in scopes] == ["Locals", "Globals"]
    local = {
        v["name"]: v
        for v in dap.ok("variables", variablesReference=scopes[0]["variablesReference"])[
            "variables"
        ]
    }
    assert local["x"]["value"] == "10" and local["x"]["variablesReference"] == 0
    assert local["t"]["value"] == "tensor(shape=(3, 4), dtype=torch.float32, device=cpu)"
    meta = dap.ok("variables", variablesReference=local["t"]["variablesReference"])["variables"]
    assert {v["name"]: v["value"] for v in meta}["shape"] == "(3, 4)"
    assert (
        dap.ok("evaluate", expression="x + 5", frameId=top["id"], context="repl")["result"] == "15"
    )
    big = dap.ok("evaluate", expression="list(range(10_000_000))", frameId=top["id"])
    assert big["result"].startswith("list(len=10000000) [0, 1, 2") and len(big["result"]) <= 300
    huge = dap.ok("evaluate", expression="torch.empty(2**28)", frameId=top["id"])  # 1 GB
    assert huge["result"] == "tensor(shape=(268435456,), dtype=torch.float32, device=cpu)"
    bad = dap.request("evaluate", expression="nope + 1", frameId=top["id"])
    assert bad["success"] is False and "NameError" in bad["message"]

    dap.ok("next", threadId=tid)
    dap.wait_event(stopped(tid, "step"))
    assert dap.ok("stackTrace", threadId=tid)["stackFrames"][0]["line"] == 7
    stale = dap.request("scopes", frameId=top["id"])  # a frame id of before the step
    assert stale["success"] is False and "ran on" in stale["message"]

    for t in (tid, threads[0]):
        dap.ok("continue", threadId=t)
        dap.wait_event(lambda ev, t=t: ev["event"] == "thread" and ev["body"]["threadId"] == t)
        if t == tid:  # JupyterLab shows one thread's frames: the other paused rank, again
            again = dap.wait_event(stopped(threads[0]))
            assert again["body"]["description"] == "rank 0 · default still paused"
    assert not {t["id"] for t in dap.ok("threads")["threads"]} & set(threads.values())
    got = k.value(
        "[r['data']['text/plain'] for r in held.result(timeout=30)]", output_hook=dap.hook
    )
    assert got == ["1", "11"]

    # a thread that no longer exists: a clear error, at once
    gone = dap.request("stackTrace", threadId=tid)
    assert gone["success"] is False and f"thread id {tid}" in gone["message"]
    assert dap.request("next", threadId=THREAD_BASE + 999)["success"] is False
    # the mesh keeps serving
    assert k.value("mnb.get_mesh().exec('rank + 1').fetch(timeout=20)", output_hook=dap.hook) == [
        1,
        2,
    ]


STEP_CELL = """%%monarch --noblock -o stepped
def f(a):
    b = a * 3
    return b

breakpoint()
r = f(rank)
r + 100"""


def test_step_in_and_out_of_a_function_on_a_rank(k, dap):
    k.ok(STEP_CELL, output_hook=dap.hook)
    tids = {}
    for _ in range(2):
        ev = dap.wait_event(
            lambda ev: ev["event"] == "stopped" and ev["body"]["threadId"] >= THREAD_BASE
        )
        tids[ev["body"]["description"].split(" ")[1]] = ev["body"]["threadId"]
    tid = tids["1"]

    def top():
        return dap.ok("stackTrace", threadId=tid)["stackFrames"][0]

    assert (top()["name"], top()["line"]) == ("<module> · rank 1", 7)
    dap.ok("stepIn", threadId=tid)
    dap.wait_event(stopped(tid, "step"))
    frames = dap.ok("stackTrace", threadId=tid)["stackFrames"]
    assert [f["name"] for f in frames[:2]] == ["f · rank 1", "<module> · rank 1"]
    scopes = dap.ok("scopes", frameId=frames[0]["id"])["scopes"]
    local = dap.ok("variables", variablesReference=scopes[0]["variablesReference"])
    assert {v["name"]: v["value"] for v in local["variables"]} == {"a": "1"}
    # the caller's frame is a frame too: evaluate there
    assert dap.ok("evaluate", expression="rank", frameId=frames[1]["id"])["result"] == "1"
    dap.ok("stepOut", threadId=tid)
    dap.wait_event(stopped(tid, "step"))
    after = top()
    assert (after["name"], after["line"]) == ("<module> · rank 1", 7)
    assert dap.ok("evaluate", expression="r", frameId=after["id"])["result"] == "3"  # f returned
    assert dap.ok("pause", threadId=tid) == {}  # paused already: nothing to do
    for t in tids.values():
        dap.ok("continue", threadId=t)
    got = k.value(
        "[r['data']['text/plain'] for r in stepped.result(timeout=30)]", output_hook=dap.hook
    )
    assert got == ["100", "103"]


def test_with_the_panel_attached_a_paused_cell_asks_no_stdin(k, dap):
    """The panel serves the paused ranks of a blocking cell: no inline prompt (a stdin
    request could not be taken back once the panel continued them)."""
    msg_id = k.kc.execute("%%monarch\nbreakpoint()\nrank * 10", allow_stdin=True)
    tids, texts, continued = set(), [], False
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, f"the cell did not end; paused: {tids}"
        told = "the debugger panel shows the paused ranks" in "".join(texts)
        if len(tids) == 2 and told and not continued:
            for tid in tids:
                dap.ok("continue", threadId=tid)
            continued = True
        try:
            msg = k.kc.get_iopub_msg(timeout=1)
        except queue.Empty:
            continue
        body = msg["content"].get("body") or {}
        if msg["msg_type"] == "debug_event" and msg["content"]["event"] == "stopped":
            if body.get("threadId", 0) >= THREAD_BASE:
                tids.add(body["threadId"])
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            texts.append(msg["content"]["text"])
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    assert continued
    assert "the debugger panel shows the paused ranks" in "".join(texts)
    with pytest.raises(queue.Empty):
        k.kc.get_stdin_msg(timeout=0.5)  # it never asked for a line
    assert k.value("1 + 1") == 2


def test_a_worker_that_dies_while_paused_leaves_the_threads(k, dap):
    """Last in the module: it breaks the mesh."""
    k.ok("%%monarch --noblock\nif rank == 1:\n    breakpoint()\nrank", output_hook=dap.hook)
    ev = dap.wait_event(
        lambda ev: ev["event"] == "stopped" and ev["body"]["threadId"] >= THREAD_BASE
    )
    tid, since = ev["body"]["threadId"], ev["seq"]
    pid = k.value("mnb.get_mesh().status()['ranks'][1]['pid']", output_hook=dap.hook)
    psutil.Process(pid).kill()
    dap.wait_event(
        lambda ev: ev["event"] == "thread" and ev["body"]["threadId"] == tid and ev["seq"] > since
    )
    assert tid not in {t["id"] for t in dap.ok("threads")["threads"]}
    gone = dap.request("stackTrace", threadId=tid)
    assert gone["success"] is False and f"thread id {tid}" in gone["message"]
