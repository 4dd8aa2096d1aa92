"""The kernel end of the JupyterLab extension (``extension/``): the ``monarch_nb`` comm.

Loading the IPython extension registers the comm target ``TARGET`` and opens one
*beacon* comm to the front-ends (``{"event": "hello", "version": ...}``). A Lab
with the extension answers by opening a comm of its own to the target; a Lab
that connects later (a reload, a second tab) finds the beacon with a
``comm_info_request`` for the target. So a kernel without monarch_nb is never
sent anything, and never logs an unknown target.

On a front-end's comm, kernel -> front-end::

    {"event": "status", "mesh": <render.summary(...), "id" and "auto"> | null}
        when the comm opens, then whenever it changes (the dashboards' redraw
        thread: at most 10 a second, nothing while nothing changes)
    {"reply": <request>, "id": <id>, ...}    the answer to a request

front-end -> kernel::

    {"request": "dashboard", "id"}  -> {"model_id"}: a live Dashboard widget of the
                                       active mesh, without its debugger part
    {"request": "pdb", "id", "target": [rank, stream] | "*", "line"}
                                    -> {"lines"}: the command and its output
    {"request": "continue", "id"}   -> {"lines"}: every paused session goes on

Requests run on one thread of the channel, never in the comm handler: a pdb
command waits for its reply at most ``COMMAND_WAIT`` seconds.
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

from .._version import __version__
from ..api import mesh as mesh_mod
from ..ui import debugger_panel, render
from ..ui.redraw import LOOP, snapshot

logger = logging.getLogger("monarch_nb.lab")

TARGET = "monarch_nb"


def active_mesh():
    """The mesh the notebook's magics and the Lab extension show; None without one."""
    try:
        return mesh_mod.get_mesh()
    except RuntimeError:
        return None


class LabChannel:
    """The comms of every Lab front-end connected to this kernel."""

    def __init__(self, views, auto_of=lambda: None):
        """``auto_of()``: the %%monarch arguments of auto mode (None: off)."""
        from comm import create_comm, get_comm_manager

        self._manager = get_comm_manager()
        self._lock = threading.Lock()
        self._comms: dict = {}  # comm id -> comm
        self._sent: dict[str, str] = {}  # comm id -> the last status sent (JSON)
        self._dashboards: dict = {}  # comm id -> (mesh.key, Dashboard)
        self._views = views  # MeshViews: makes the panel's dashboards
        self._auto_of = auto_of
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self._manager.register_target(TARGET, self._opened)
        self._beacon = create_comm(
            target_name=TARGET, data={"event": "hello", "version": __version__}
        )

    # ------------------------------------------------------------ comms

    def _opened(self, comm, msg) -> None:
        with self._lock:
            if self._closed:
                comm.close()
                return
            self._comms[comm.comm_id] = comm
        comm.on_msg(self._on_msg)
        comm.on_close(lambda _msg, cid=comm.comm_id: self._forget(cid))
        self.redraw()
        LOOP.add(self)

    def _forget(self, cid: str) -> None:
        with self._lock:
            self._comms.pop(cid, None)
            self._sent.pop(cid, None)
            old = self._dashboards.pop(cid, None)
            if not self._comms:
                LOOP.remove(self)
        if old is not None:
            old[1].close()

    def redraw(self, cache: dict | None = None) -> None:
        """Send each comm the status if it changed (the redraw thread calls this)."""
        mesh = active_mesh()
        summary = None
        if mesh is not None:  # "id": a new mesh of the same name is another mesh
            summary = {**render.summary(*snapshot(mesh, cache)), "id": mesh.key}
            summary["auto"] = self._auto_of()  # %monarch_auto's arguments, or None
        text = json.dumps(summary, sort_keys=True)
        with self._lock:
            todo = [(cid, c) for cid, c in self._comms.items() if self._sent.get(cid) != text]
            for cid, _ in todo:
                self._sent[cid] = text
        for _, c in todo:
            c.send({"event": "status", "mesh": summary})

    def close(self) -> None:
        """The IPython extension unloads: every comm closes (the item and panel go quiet)."""
        with self._lock:
            self._closed = True
            comms, self._comms = list(self._comms.values()), {}
            dashboards, self._dashboards = list(self._dashboards.values()), {}
        LOOP.remove(self)
        for _, d in dashboards:
            d.close()
        for c in comms:
            c.close()
        self._beacon.close()
        self._manager.unregister_target(TARGET, self._opened)
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    # ------------------------------------------------------------ requests

    def _on_msg(self, msg) -> None:
        content = msg["content"]
        cid = content["comm_id"]
        data = content.get("data") or {}
        kind = data.get("request")
        comm = self._comms.get(cid)
        if comm is None:
            return
        if kind == "dashboard":  # widgets are made here, on the kernel's main thread
            self._reply(comm, data, self._dashboard(cid))
            return
        if kind not in ("pdb", "continue"):
            self._reply(comm, data, {"error": f"unknown request {kind!r}"})
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="monarch-nb-lab")
        self._pool.submit(self._serve, comm, data)

    def _reply(self, comm, request: dict, answer: dict) -> None:
        comm.send({"reply": request.get("request"), "id": request.get("id"), **answer})

    def _serve(self, comm, data: dict) -> None:
        try:
            mesh = active_mesh()
            if mesh is None:
                answer = {"lines": ["no mesh in this kernel"]}
            elif data["request"] == "pdb":
                target = data.get("target")
                if isinstance(target, list):
                    target = tuple(target)
                lines: list[str] = []
                debugger_panel.debugger_command(mesh, target, str(data.get("line", "")), lines.append)
                answer = {"lines": lines}
            else:
                answer = {"lines": [debugger_panel.continue_all(mesh)]}
        except Exception as e:
            logger.exception("monarch_nb: a Lab request failed")
            answer = {"lines": [f"{type(e).__name__}: {e}"]}
        self._reply(comm, data, answer)

    def _dashboard(self, cid: str) -> dict:
        mesh = active_mesh()
        if mesh is None:
            return {"model_id": None}
        key = mesh.key
        old = self._dashboards.get(cid)
        if old is not None and old[0] == key and old[1].live:
            return {"model_id": old[1].model_id}
        d = self._views.extra(mesh, debugger=False)
        d.add_class("mnb-lab-dashboard")
        self._dashboards[cid] = (key, d)
        if old is not None:
            old[1].close()
        return {"model_id": d.model_id}
