"""DAP over a kernel's control channel, for the kernel-tier debugger tests."""

from __future__ import annotations

import itertools
import queue
import time


class Dap:
    """DAP requests as debug_request messages on the kernel's control channel."""

    def __init__(self, kern):
        self.kern = kern
        self.seq = itertools.count(1)
        self.events: list = []

    def request(self, command: str, timeout: float = 30, **arguments) -> dict:
        kc = self.kern.kc
        content = {"seq": next(self.seq), "type": "request", "command": command}
        content["arguments"] = arguments
        msg = kc.session.msg("debug_request", content)
        kc.control_channel.send(msg)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"no debug_reply to {command} in {timeout} s"
            try:
                rep = kc.control_channel.get_msg(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if rep["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                return rep["content"]

    def ok(self, command: str, **arguments) -> dict:
        rep = self.request(command, **arguments)
        assert rep.get("success"), (command, rep)
        return rep.get("body", {})

    def hook(self, msg) -> None:
        """An output_hook for the kernel's execute calls: keep the debug events they read."""
        if msg["msg_type"] == "debug_event":
            self.events.append(msg["content"])

    def wait_event(self, match, timeout: float = 30) -> dict:
        """The first debug_event (seen before or now) for which ``match(event)`` holds."""
        deadline = time.monotonic() + timeout
        while True:
            for i, ev in enumerate(self.events):
                if match(ev):
                    return self.events.pop(i)
            left = deadline - time.monotonic()
            if left <= 0:
                got = [(e["event"], e.get("body")) for e in self.events]
                raise TimeoutError(f"no matching debug_event in {timeout} s; got {got}")
            try:
                msg = self.kern.kc.get_iopub_msg(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if msg["msg_type"] == "debug_event":
                self.events.append(msg["content"])


def start(k) -> Dap:
    dap = Dap(k)
    dap.ok(
        "initialize",
        clientID="test",
        adapterID="python",
        pathFormat="path",
        linesStartAt1=True,
        columnsStartAt1=True,
        supportsVariableType=True,
        supportsVariablePaging=True,
    )
    dap.ok("attach")
    return dap


def stopped(tid, reason=None):
    def match(ev):
        b = ev.get("body", {})
        return (
            ev["event"] == "stopped"
            and b.get("threadId") == tid
            and (reason is None or b.get("reason") == reason)
        )

    return match
