"""``dap_variables``: one DAP ``variables`` request as JupyterLab's debugger panel sends it.

One real kernel, with JupyterLab's debugger switched on (initialize, attach,
configurationDone over the control channel), holds two paused threads at once:

* ours: rank 0 of ``local_mesh(dp=1)`` paused in a ``%%monarch --noblock`` cell
  (``breakpoint()``), a remote thread of notebook/dap.py; ``variables`` of its
  Locals goes kernel -> controller -> the worker's pdb -> back;
* baseline: the kernel itself paused by debugpy at a gutter breakpoint in a plain
  cell with the same locals; ``variables`` of its Locals is debugpy's answer.

Each measurement is the median over ``n`` requests of the interval from sending a
``debug_request`` to its ``debug_reply``; the two alternate (after a warm-up), and
the numbers are medians over the repetitions. Target: ours <= 50 ms (absolute).
"""

from __future__ import annotations

import itertools
import os
import queue
import statistics
import tempfile
import time

from ._report import Entry, interleaved

LIMIT_MS = 50.0
OURS_CELL = "%%monarch --noblock\nx = 5\nitems = list(range(100))\nname = 'r'\nbreakpoint()\npass"
BASE_CELL = (
    "def held():\n    x = 5\n    items = list(range(100))\n    name = 'k'\n    return x\n\nheld()"
)
REMOTE = 1 << 30  # notebook/dap.py's first remote thread id


class AbsoluteEntry(Entry):
    """An entry whose target is an absolute bound on ours (``"<= 50 ms"``); ``ratio`` is
    still ours / baseline, for the record."""

    def __post_init__(self) -> None:
        if not (self.target.startswith("<= ") and self.target.endswith(" ms")):
            raise ValueError(f"bad absolute target {self.target!r}")

    @property
    def ok(self) -> bool:
        bound = float(self.target[3:-3])
        return self.ours == self.ours and self.ours <= bound


class _DapKernel:
    def __init__(self):
        from monarch_nb.headless import start_kernel

        self._tmp = tempfile.TemporaryDirectory(prefix="monarch-bench-dap-")
        env = dict(os.environ, IPYTHONDIR=os.path.join(self._tmp.name, "ipython"))
        env.update(JUPYTER_PLATFORM_DIRS="1", PYDEVD_DISABLE_FILE_VALIDATION="1")
        self.km, self.kc = start_kernel("python3", timeout=60, env=env, cwd=self._tmp.name)
        self._seq = itertools.count(1)
        self.events: list = []

    def run(self, code: str, timeout: float = 120) -> None:
        reply = self.kc.execute_interactive(code, timeout=timeout, output_hook=self._keep)
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"{code!r} failed in the kernel: {reply['content']}")

    def _keep(self, msg) -> None:
        if msg["msg_type"] == "debug_event":
            self.events.append(msg["content"])

    def request(self, command: str, timeout: float = 30, **arguments) -> dict:
        content = {"seq": next(self._seq), "type": "request", "command": command}
        content["arguments"] = arguments
        msg = self.kc.session.msg("debug_request", content)
        self.kc.control_channel.send(msg)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                rep = self.kc.control_channel.get_msg(timeout=1.0)
            except queue.Empty:
                continue
            if rep["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                if not rep["content"].get("success"):
                    raise RuntimeError(f"{command}: {rep['content'].get('message')}")
                return rep["content"].get("body", {})
        raise TimeoutError(f"no debug_reply to {command} in {timeout} s")

    def stopped(self, remote: bool, timeout: float = 60) -> int:
        """The thread id of the next stopped event on a remote (or the kernel's) thread."""
        deadline = time.monotonic() + timeout
        while True:
            for i, ev in enumerate(self.events):
                tid = ev.get("body", {}).get("threadId", 0)
                if ev["event"] == "stopped" and (tid >= REMOTE) == remote:
                    del self.events[i]
                    return tid
            if time.monotonic() > deadline:
                raise TimeoutError("no stopped event")
            try:
                self._keep(self.kc.get_iopub_msg(timeout=1.0))
            except queue.Empty:
                pass

    def locals_ref(self, tid: int) -> int:
        frame = self.request("stackTrace", threadId=tid)["stackFrames"][0]
        return self.request("scopes", frameId=frame["id"])["scopes"][0]["variablesReference"]

    def close(self) -> None:
        try:
            self.kc.stop_channels()
            self.km.shutdown_kernel(now=False)
        finally:
            self._tmp.cleanup()


def _median_request(k: _DapKernel, ref: int, n: int) -> float:
    """Median seconds of one ``variables`` request for ``ref`` (checked: x is there)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        body = k.request("variables", variablesReference=ref)
        times.append(time.perf_counter() - t0)
        if {v["name"]: v["value"] for v in body["variables"]}.get("x") != "5":
            raise RuntimeError(f"variables answered without x = 5: {body}")
    return statistics.median(times)


def bench_dap_variables(quick: bool) -> list[Entry]:
    n, reps = (10, 3) if quick else (30, 7)
    k = _DapKernel()
    try:
        k.run("%load_ext monarch_nb")
        k.run("%monarch_mesh dp=1")
        k.request("initialize", clientID="bench", adapterID="python", pathFormat="path")
        k.request("attach")
        k.request("configurationDone")
        k.run(OURS_CELL)
        ours_ref = k.locals_ref(k.stopped(remote=True))
        path = k.request("dumpCell", code=BASE_CELL)["sourcePath"]
        k.request("setBreakpoints", source={"path": path}, breakpoints=[{"line": 5}])
        msg_id = k.kc.execute(BASE_CELL)
        base_tid = k.stopped(remote=False)
        base_ref = k.locals_ref(base_tid)
        ours, base, _, _ = interleaved(
            lambda: _median_request(k, ours_ref, n), lambda: _median_request(k, base_ref, n), reps
        )
        k.request("setBreakpoints", source={"path": path}, breakpoints=[])
        k.request("continue", threadId=base_tid)
        _wait_reply(k, msg_id)
        k.request("disconnect", restart=False, terminateDebuggee=False)
        k.run("%monarch_debug continue")
        k.run("%monarch_mesh --shutdown")
    finally:
        k.close()
    return [
        AbsoluteEntry(
            "dap_variables",
            ours * 1e3,
            base * 1e3,
            "ms",
            f"<= {LIMIT_MS:g} ms",
            "the same `variables` request (Locals of a paused plain cell) answered by the "
            "kernel's own debugpy",
            note=(
                "JupyterLab's debugger on, `variables` of the Locals of rank 0 paused in a "
                "`%%monarch` cell on local_mesh(dp=1): control channel -> kernel -> controller "
                f"-> worker pdb -> back; median of {n} requests, median over {reps} "
                "alternating reps; target absolute"
            ),
        )
    ]


def _wait_reply(k: _DapKernel, msg_id: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            rep = k.kc.get_shell_msg(timeout=1.0)
        except queue.Empty:
            continue
        if rep["parent_header"].get("msg_id") == msg_id:
            return
    raise TimeoutError("the debugged plain cell did not finish")


BENCHMARKS = [("dap_variables", bench_dap_variables)]
