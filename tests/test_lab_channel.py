"""The kernel end of the JupyterLab extension: the ``monarch_nb`` comm, driven the way the
extension drives it (comm_info, comm_open, comm_msg) through a real kernel."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
from kernel_helpers import Kernel
from wait_helpers import wait_for

from monarch_nb.ui import render

pytestmark = pytest.mark.kernel

TARGET = "monarch_nb"


class Front:
    """A front-end's end of one comm to the kernel's ``monarch_nb`` target."""

    def __init__(self, kern: Kernel):
        self.kern = kern
        self.comm_id = uuid.uuid4().hex
        self.seen: list[dict] = []  # data of every comm_msg on this comm
        self.cursor = 0  # seen[:cursor] were looked at by an earlier wait
        self.closed = False

    def send(self, msg_type: str, content: dict) -> None:
        kc = self.kern.kc
        kc.shell_channel.send(kc.session.msg(msg_type, content))

    def open(self) -> None:
        self.send("comm_open", {"comm_id": self.comm_id, "target_name": TARGET, "data": {}})

    def request(self, **data) -> dict:
        data["id"] = uuid.uuid4().hex
        self.send("comm_msg", {"comm_id": self.comm_id, "data": data})
        return self.wait(lambda d: d.get("id") == data["id"], what=f"the reply to {data}")

    def close(self) -> None:
        self.send("comm_close", {"comm_id": self.comm_id, "data": {}})

    def record(self, msg) -> None:
        """An IOPub message, whoever read it: this comm's are kept."""
        c = msg["content"]
        if c.get("comm_id") == self.comm_id:
            if msg["msg_type"] == "comm_msg":
                self.seen.append(c["data"])
            elif msg["msg_type"] == "comm_close":
                self.closed = True

    def pump(self, timeout: float) -> None:
        """Read IOPub for ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.record(self.kern.kc.get_iopub_msg(timeout=0.2))
            except Exception:
                continue

    def ok(self, code: str, timeout: float = 60):
        """Run ``code`` in the kernel; the pushes that arrive meanwhile are kept."""
        return self.kern.ok(code, timeout, output_hook=self.record)

    def value(self, expr: str):
        return self.kern.value(expr, output_hook=self.record)

    def wait(self, pred, timeout: float = 30, what: str = "a message") -> dict:
        """The first message from the cursor on that satisfies ``pred``."""
        deadline = time.monotonic() + timeout
        while True:
            while self.cursor < len(self.seen):
                d = self.seen[self.cursor]
                self.cursor += 1
                if pred(d):
                    return d
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {timeout} s; got {self.seen[-5:]}")
            self.pump(0.2)

    def status(self, pred, timeout: float = 30) -> dict | None:
        """The first status push from the cursor on whose mesh summary satisfies
        ``pred`` (pushes without a mesh never do, unless ``pred`` is None)."""
        d = self.wait(
            lambda d: (
                d.get("event") == "status"
                and (
                    d["mesh"] is None if pred is None else d["mesh"] is not None and pred(d["mesh"])
                )
            ),
            timeout,
            "such a status",
        )
        return d["mesh"]


def comm_info(kern: Kernel) -> dict:
    kc = kern.kc
    msg_id = kc.comm_info(target_name=TARGET)
    while True:
        reply = kc.get_shell_msg(timeout=10)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"]["comms"]


@pytest.fixture()
def kern(tmp_path):
    k = Kernel(tmp_path)
    try:
        yield k
    finally:
        k.shutdown()


def test_the_channel_serves_status_dashboard_and_debugger(kern):
    # a kernel without monarch_nb has no such comm: the extension never opens one
    assert comm_info(kern) == {}
    msgs = kern.ok("%load_ext monarch_nb\nimport monarch_nb as mnb")
    opens = [m["content"] for m in msgs if m["msg_type"] == "comm_open"]
    assert [(o["target_name"], o["data"]["event"]) for o in opens] == [(TARGET, "hello")]
    beacon = opens[0]["comm_id"]
    assert beacon in comm_info(kern)  # what a reloaded page finds

    front = Front(kern)
    front.open()
    assert front.status(None) is None  # no mesh yet: the item stays hidden
    front.ok("%monarch_mesh dp=2", timeout=120)
    s = front.status(lambda s: s["alive"] == 2)
    assert (s["shape"], s["total"], s["state"], s["paused"], s["errors"]) == ("dp=2", 2, "ok", 0, 0)
    assert s["id"] == front.value("mnb.get_mesh().key")

    # the panel's dashboard: a live Dashboard widget (main, buttons, errors, activity),
    # without the debugger part
    reply = front.request(request="dashboard")
    model = reply["model_id"]
    assert model
    assert front.request(request="dashboard")["model_id"] == model  # one per comm and mesh
    d = front.value(
        f"[(type(w).__name__, w._dom_classes, len(w.children)) "
        f"for w in __import__('ipywidgets').Widget.widgets.values() if w.model_id == {model!r}]"
    )
    assert d == [("Dashboard", ("mnb-dashboard", "mnb-lab-dashboard"), 4)]

    # a failure and a paused session show in the summary; pdb commands are served
    front.ok("_ = mnb.get_mesh().exec('1 / (1 - rank)')")
    front.status(lambda s: s["errors"] == 1)
    front.ok("%%monarch --noblock --ranks 1\nx = 41 + rank\nbreakpoint()\nprint('after', x)")
    s = front.status(lambda s: s["paused"] == 1)
    assert s["busy"] == [1]
    assert [(x["rank"], x["stream"]) for x in s["sessions"]] == [(1, "default")]
    assert s["sessions"][0]["label"].startswith("rank 1 · default · <monarch In[")
    reply = front.request(request="pdb", target=[1, "default"], line="p x")
    assert reply["lines"] == ["(Pdb r1) p x", "42"]
    reply = front.request(request="pdb", target=[0, "default"], line="p x")
    assert reply["lines"] == ["p x: no paused session on rank 0 (default)"]
    reply = front.request(request="continue")
    assert reply["lines"] == ["continued 1 session(s)"]
    front.status(lambda s: s["paused"] == 0 and s["busy"] == [])
    assert "unknown request" in front.request(request="frobnicate")["error"]

    # a killed worker shows within seconds
    pid = front.value("mnb.get_mesh().status()['ranks'][1]['pid']")
    os.kill(pid, signal.SIGKILL)
    s = front.status(lambda s: s["alive"] == 1, timeout=15)
    assert s["total"] == 2 and "1" in s["dead"] and "SIGKILL" in s["dead"]["1"]

    # a closed comm is forgotten; unloading closes the rest (the item goes quiet)
    second = Front(kern)
    second.open()
    second.status(lambda s: True)
    second.close()
    live = "len(__import__('monarch_nb.notebook').notebook._loaded[id(get_ipython())].lab._comms)"
    wait_for(lambda: kern.value(live) == 1, 10, "the closed comm to be forgotten", 0.1)
    msgs = kern.ok("%unload_ext monarch_nb")
    closed = {m["content"]["comm_id"] for m in msgs if m["msg_type"] == "comm_close"}
    assert {front.comm_id, beacon} <= closed
    assert comm_info(kern) == {}


def test_summary_counts_what_the_status_item_shows():
    status = {
        "name": "m",
        "dims": {"dp": 2, "tp": 2},
        "backend": "gloo",
        "generation": 3,
        "ranks": {
            0: {"alive": True, "exit": None, "streams": {"default": {"running": 1, "queued": 2}}},
            1: {
                "alive": True,
                "exit": None,
                # paused in the debugger before its progress says "running": busy too
                "streams": {"default": {"running": None, "queued": 0, "paused": {"line": 3}}},
            },
            2: {"alive": False, "exit": "killed by SIGKILL", "streams": {}},
            3: {"alive": True, "exit": None, "streams": {"s": {"running": None, "queued": 1}}},
        },
        "errors": [{"ranks": [0, 1]}, {"ranks": [3]}],
        "debugger": [{"rank": 0, "stream": "default", "file": "f.py", "line": 3, "function": "g"}],
    }
    s = render.summary(status)
    assert s["shape"] == "dp=2 tp=2" and (s["alive"], s["total"]) == (3, 4)
    assert s["busy"] == [0, 1] and s["queued"] == 3
    assert s["dead"] == {"2": "killed by SIGKILL"}
    assert (s["paused"], s["errors"]) == (1, 3)
    assert s["sessions"] == [
        {"rank": 0, "stream": "default", "label": "rank 0 · default · f.py:3 g"}
    ]
    assert render.summary(status, "shut down")["dead"] == {}
