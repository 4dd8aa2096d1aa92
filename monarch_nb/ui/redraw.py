"""The one thread that redraws every live view (dashboards, the Lab extension's
status feed) at a bounded rate, from one snapshot per mesh per pass.

Cost is bounded whatever the command rate: ``RedrawLoop`` redraws at most
``REDRAW_PERIOD`` apart (10 a second); when a pass costs more than
``MAX_OVERHEAD`` of the CPU time, the passes space out (at most ``MAX_WAIT``
apart). No widgets here: a view is anything with ``redraw(snapshots)``.
"""

from __future__ import annotations

import logging
import threading
import time

from . import render

logger = logging.getLogger("monarch_nb.ui")

REDRAW_PERIOD = 0.1  # seconds between redraws: at most 10 a second
MAX_OVERHEAD = 0.05  # the redraw thread's share of the CPU time, at most
MAX_WAIT = 2.0  # seconds a live view goes without a redraw, at most


class RedrawLoop:
    """One daemon thread that redraws every live view, at most 10 times a second.

    A view is a ``Dashboard`` or anything else with ``redraw(snapshots)`` (the
    JupyterLab extension's status feed); one pass takes one snapshot per mesh,
    shared by every view (``snapshot``). A view of one mesh (a ``Dashboard``)
    names it as ``mesh``."""

    def __init__(self, period: float = REDRAW_PERIOD):
        self.period = period
        self.passes = 0
        self.cpu = 0.0  # the passes' CPU time, in seconds (the thread's own)
        # reentrant: the garbage collector may run an old dashboard's __del__ (close ->
        # remove) on a thread that holds it, at any allocation inside it
        self._lock = threading.RLock()
        self._dashboards: list = []
        self._thread: threading.Thread | None = None

    def add(self, d) -> None:
        start = None
        with self._lock:
            if d not in self._dashboards:
                self._dashboards.append(d)
            if self._thread is None:
                self._thread = start = threading.Thread(
                    target=self._run, name="monarch-nb-ui", daemon=True
                )
        # started outside the lock: the new thread may run a finalizer first (the garbage
        # collector's choice: an old dashboard's __del__ -> remove()), which takes it
        if start is not None:
            start.start()

    def remove(self, d) -> None:
        with self._lock:
            if d in self._dashboards:
                self._dashboards.remove(d)

    def dashboards(self, key: int | None = None) -> list:
        """The live views of one mesh (of ``mesh.key``; None: of any mesh)."""
        with self._lock:
            views = [(d, getattr(d, "mesh", None)) for d in self._dashboards]
        return [d for d, m in views if m is not None and (key is None or m.key == key)]

    def _run(self) -> None:
        wait, recent = self.period, []
        while True:
            time.sleep(wait)
            with self._lock:
                live = list(self._dashboards)
                if not live:
                    self._thread = None
                    return
            # the pass's own CPU time: waiting for the GIL while the kernel's main
            # thread works (a mesh starting) is not cost, and must not space passes out
            t0 = time.thread_time()
            snapshots: dict = {}  # one snapshot per mesh per pass, whatever the dashboards
            for d in live:
                try:
                    d.redraw(snapshots)
                except Exception:
                    logger.exception("monarch_nb dashboard redraw failed (continuing)")
            self.passes += 1
            cost = time.thread_time() - t0
            self.cpu += cost
            # spaced by the dearest of the last few passes: a cheap pass (nothing
            # changed) between dear ones (widget updates sent) must not pull them closer
            recent = (recent + [cost])[-4:]
            wait = min(MAX_WAIT, max(self.period, max(recent) * (1.0 / MAX_OVERHEAD - 1.0)))


LOOP = RedrawLoop()


def dashboards_of(mesh) -> list:
    """The live dashboards of ``mesh`` (and of its slices: they share its key)."""
    return LOOP.dashboards(mesh.key)


def snapshot(mesh, cache: dict | None = None) -> tuple[dict, str]:
    """``(mesh.status(), render.mesh_state(...))``, taken once per redraw pass:
    ``cache`` is the pass's (keyed by ``mesh.key``; slices share it)."""
    key = mesh.key
    if cache is not None and key in cache:
        return cache[key]
    status = mesh.status()
    state = render.mesh_state(status, mesh.alive, mesh.closed)
    if cache is not None:
        cache[key] = (status, state)
    return status, state
