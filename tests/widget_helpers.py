"""The browser's part of the Jupyter widget protocol, played by a test.

``Widgets`` keeps every model the kernel opened (its state from ``comm_open``
merged with later ``comm_msg`` updates), finds models by their ``mnb-...``
class, and sends what a widget view sends: ``update`` (a Text's value after
Enter) and ``custom`` click events (a Button).
"""

from __future__ import annotations

import html
import time


class Widgets:
    def __init__(self, k):
        self.k = k
        self.state: dict[str, dict] = {}  # comm_id -> merged state
        self.order: list[str] = []  # comm ids, oldest first
        self.updates: list[tuple] = []  # (comm_id, state delta, kernel timestamp)
        self.msgs: list[dict] = []  # every IOPub message fed, in order

    def of(self, msg_id: str) -> list[dict]:
        """The messages fed so far that belong to request ``msg_id``."""
        return [m for m in self.msgs if m["parent_header"].get("msg_id") == msg_id]

    def feed(self, msgs) -> None:
        for m in msgs:
            self.msgs.append(m)
            kind = m["msg_type"]
            c = m["content"]
            if kind == "comm_open":
                self.state[c["comm_id"]] = dict(c["data"].get("state", {}))
                self.order.append(c["comm_id"])
            elif kind == "comm_msg":
                data = c.get("data", {})
                if data.get("method") in ("update", "echo_update"):
                    self.state.setdefault(c["comm_id"], {}).update(data.get("state", {}))
                    self.updates.append((c["comm_id"], data.get("state", {}), m["header"]["date"]))
            elif kind == "comm_close":
                self.state.pop(c["comm_id"], None)

    def all(self, cls: str) -> list[str]:
        return [cid for cid in self.order if cls in self.state.get(cid, {}).get("_dom_classes", ())]

    def find(self, cls: str) -> str:
        """The newest open model with class ``cls``."""
        found = self.all(cls)
        assert found, f"no widget with class {cls!r}"
        return found[-1]

    def value(self, cid: str, key: str = "value"):
        return self.state[cid].get(key)

    # ------------------------------------------------------------ what a view sends

    def send(self, cid: str, data: dict) -> None:
        kc = self.k.kc
        kc.shell_channel.send(kc.session.msg("comm_msg", {"comm_id": cid, "data": data}))

    def update(self, cid: str, **state) -> None:
        self.send(cid, {"method": "update", "state": state, "buffer_paths": []})

    def click(self, cid: str) -> None:
        self.send(cid, {"method": "custom", "content": {"event": "click"}})

    # ------------------------------------------------------------ waiting

    def pump(self, seconds: float) -> list:
        """Every IOPub message for ``seconds`` (fed into the models)."""
        out: list = []
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            try:
                out.append(self.k.kc.get_iopub_msg(timeout=min(left, 0.2)))
            except Exception:
                continue
        self.feed(out)
        return out

    def wait(self, cid: str, pred, timeout: float = 30, key: str = "value"):
        """Read IOPub until ``pred(state[cid][key])`` holds; that value."""
        deadline = time.monotonic() + timeout
        while True:
            v = self.state.get(cid, {}).get(key)
            if pred(v):
                return v
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{key} of {cid} after {timeout} s: {str(v)[-2000:]}")
            try:
                msg = self.k.kc.get_iopub_msg(timeout=min(left, 0.5))
            except Exception:
                continue
            self.feed([msg])

    def wait_msgs(self, msg_id: str, pred, timeout: float = 30) -> list:
        """Read IOPub until ``pred(messages of request msg_id)`` holds; those messages."""
        deadline = time.monotonic() + timeout
        while not pred(self.of(msg_id)):
            left = deadline - time.monotonic()
            if left <= 0:
                got = [m["msg_type"] for m in self.of(msg_id)]
                raise TimeoutError(f"request {msg_id}: waited {timeout} s; got {got}")
            try:
                self.feed([self.k.kc.get_iopub_msg(timeout=min(left, 0.5))])
            except Exception:
                continue
        return self.of(msg_id)

    def wait_text(self, cls: str, text: str, timeout: float = 30) -> str:
        """Wait until the (HTML) value of the newest ``cls`` widget shows ``text``; the
        value, HTML entities decoded."""
        v = self.wait(self.find(cls), lambda v: v is not None and text in html.unescape(v), timeout)
        return html.unescape(v)
