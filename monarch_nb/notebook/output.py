"""Worker output to the right cell: per-cell sinks, rank folding, coalescing.

The controller's IO thread hands every Output message to the mesh's
``OutputRouter`` (its ``mesh.output_handler``), which puts it into the sink of the cell whose command
printed it (by ident; late output of a cell that ended, from a thread or a
forked child it started, still goes under that cell), or into the mesh's
ambient sink (output of remote functions and other commands), which publishes
under whichever cell runs.

A sink (``sink.py``) keeps complete lines per stream name and rank. Every
TICK the ticker thread publishes what is ready as at most one ``stream``
message per stream name and cell, each line prefixed ``[rank r]``; identical
lines printed by several ranks fold into one ``[ranks 0-3]`` line; lines still
being written (progress bars) are drawn in place by the cell's live display.

Volume is bounded: a tick publishes at most BYTES_PER_TICK in all (well under
the 1 MB/s IOPub limit of Jupyter) and at most PENDING_CAP bytes wait in a
sink (beyond that a ``[... N bytes of output dropped ...]`` line stands where
lines were dropped). A cell publishes at most CELL_CAP bytes as stream text;
after that the live display keeps the latest lines of every rank to the end of
the cell, with a notice of how much was elided in the middle. The ambient
sink, which lives as long as its mesh, has only the rate limits.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from .publish import Publisher, Ticker
from .sink import CELL_CAP, HOLD, CellSink, dropped_notice
from .widgets import WidgetBridge

BYTES_PER_TICK = 48 << 10  # all sinks together, per tick (<= 480 KB/s)
MAX_MESSAGES_PER_TICK = 40  # all sinks together (<= 400 stream messages/s)
LATE_CELLS = 64  # ended cells whose late output still goes under them
_NONE = object()

__all__ = ["CELL_CAP", "HOLD", "CellSink", "OutputHub", "OutputRouter", "dropped_notice"]


class OutputRouter:
    """The ``output_handler`` of one mesh (its slices' too): Output -> the cell's sink."""

    def __init__(self, hub: OutputHub, mesh):
        self.hub = hub
        self.mesh = mesh
        self.sinks: dict[int, CellSink] = {}
        self.ambient = CellSink(hub.publisher, None, None)
        hub.live.add(self.ambient)
        mesh.output_handler = self.on_output
        self.blocking: set[int] = set()  # idents of cells that wait, and so serve pauses inline
        self._ended: OrderedDict = OrderedDict()  # ident -> parent of cells that ended
        self._late: OrderedDict = OrderedDict()  # ident -> sink of their late output
        mesh.debugger.listeners.append(self.on_debugger)
        mesh.liveness_listeners.append(self.on_liveness)
        self.widgets = WidgetBridge(hub.publisher, mesh, self.parent_of, hub.ticker)

    def on_output(self, msg) -> None:
        sink = self.sinks.get(msg.ident) if msg.ident is not None else None
        if sink is None or sink.closed:
            sink = self._late_sink(msg.ident) or self.ambient
        sink.add(msg.rank, msg.name, msg.text)

    def parent_of(self, ident):
        """The parent header of the cell that ran command ``ident`` (None: unknown)."""
        sink = self.sinks.get(ident) if ident is not None else None
        if sink is not None:
            return sink.parent
        parent = self._ended.get(ident, _NONE)
        return None if parent is _NONE else parent

    def _late_sink(self, ident) -> CellSink | None:
        """Output of a cell that ended (a thread or a child process it started goes
        on printing): under that cell still, as Jupyter does for a plain kernel."""
        parent = self._ended.get(ident, _NONE)
        if parent is _NONE:
            return None
        sink = self._late.get(ident)
        if sink is None:
            sink = self._late[ident] = CellSink(self.hub.publisher, parent, None)
            self.hub.live.add(sink)
            while len(self._late) > LATE_CELLS:
                _, old = self._late.popitem(last=False)
                old.finish()
                self.hub.live.discard(old)
        return sink

    def on_debugger(self, event: str, session) -> None:
        """A pause no inline prompt serves gets a one-line notice pointing to
        ``%monarch_debug``: under the cell that paused (``--noblock``), else under
        the cell that runs as it begins. It is decided at the next tick (when a
        blocking cell has claimed its pauses) and published only while the pause
        is still on: a pause over by then, or asked for (post-mortem), says nothing."""
        if event != "paused" or session.requested:
            return
        parent = self.hub.publisher.current_parent()  # the cell current as the pause begins
        debugger = self.mesh.debugger

        def tell() -> None:
            if session.ident in self.blocking or not debugger.claim_notice(session):
                return
            loc = session.location
            line = (
                f"paused in the debugger ({session.stream_name}) at {loc.get('file')}:"
                f"{loc.get('line')} in {loc.get('function')}: serve it with %monarch_debug "
                f"or the dashboard's debugger panel\n"
            )
            sink = self.sinks.get(session.ident) if session.ident is not None else None
            if sink is not None and not sink.closed:
                sink.add(session.rank, "stderr", line)  # in order with the cell's output
            else:
                once = CellSink(self.hub.publisher, parent, None)
                once.add(session.rank, "stderr", line)
                once.finish()

        self.hub.ticker.call_soon(tell)

    def on_liveness(self, event: str, info: dict) -> None:
        """A worker gone silent, or back: one line under the cell that runs now."""
        parent = self.hub.publisher.current_parent()
        who = (
            f"worker rank {info['rank']} of mesh {self.mesh.name!r} "
            f"(pid {info['pid']} on {info['host']})"
        )
        if event == "unresponsive":
            line = (
                f"monarch_nb: {who} has not been heard of for {info['silent_for']:.0f} s: "
                f"unresponsive (stopped, or in native code that holds the GIL?); "
                f"%monarch_mesh --restart gives fresh workers\n"
            )
        else:
            line = f"monarch_nb: {who} answers again\n"

        def tell() -> None:
            once = CellSink(self.hub.publisher, parent, None)
            once.add(info["rank"], "stderr", line)
            once.finish()

        self.hub.ticker.call_soon(tell)

    def close(self) -> None:
        """Publish what is left of the ambient and late output; stop ticking them."""
        self.widgets.close()
        for sink in [self.ambient, *list(self._late.values())]:
            sink.finish()
            self.hub.live.discard(sink)

    def register(self, ident: int, sink: CellSink) -> None:
        self.sinks[ident] = sink
        self.hub.live.add(sink)

    def unregister(self, ident: int) -> None:
        sink = self.sinks.pop(ident, None)
        if sink is not None:
            self.hub.live.discard(sink)
            self._ended[ident] = sink.parent
            while len(self._ended) > LATE_CELLS:
                self._ended.popitem(last=False)


class OutputHub:
    """The publisher, the ticker thread and every live sink of this kernel."""

    def __init__(self, publisher: Publisher):
        self.publisher = publisher
        self.ticker = Ticker()
        self.live: set[CellSink] = set()
        self._routers: dict[int, OutputRouter] = {}
        self._lock = threading.Lock()
        self._token = self.ticker.add(self._tick)

    def router(self, mesh) -> OutputRouter:
        """The router of ``mesh`` (by ``mesh.key``: slices share it), made on first
        use; it takes the mesh's output again if something else had taken it."""
        with self._lock:
            r = self._routers.get(mesh.key)
            if r is None:
                r = self._routers[mesh.key] = OutputRouter(self, mesh)
            elif mesh.output_handler != r.on_output:
                mesh.output_handler = r.on_output
                mesh.widget_handler = r.widgets.on_widget
            return r

    def forget(self, mesh) -> None:
        with self._lock:
            r = self._routers.pop(mesh.key, None)
        if r is not None:
            r.close()

    def _tick(self, now: float) -> None:
        sinks = [s for s in list(self.live) if s.has_pending]
        if not sinks:
            return
        budget = max(1024, BYTES_PER_TICK // len(sinks))
        sent = 0
        for s in sorted(sinks, key=id):
            if sent >= MAX_MESSAGES_PER_TICK:
                break
            sent += s.tick(now, budget)

    def close(self) -> None:
        """Stop publishing; the meshes print their output again (as in scripts)."""
        self.ticker.remove(self._token)
        with self._lock:
            routers, self._routers = list(self._routers.values()), {}
        for r in routers:
            if r.mesh.output_handler == r.on_output:
                r.mesh.output_handler = None
            r.close()
