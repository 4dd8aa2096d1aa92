"""Liveness: who has been heard of lately.

Every worker reports at least once a second (health samples from its receiver
thread, whatever its streams do). One silent for longer than
``heartbeat_timeout`` is ``unresponsive`` (in MeshState, so in ``status()`` and
the dashboard; the listeners hear of it once, and again when it answers); past
``liveness_timeout`` (None: never) it is presumed lost and ``lose`` fails every
pending call with WorkerUnresponsive.
"""

from __future__ import annotations

import logging
import time

from .errors import WorkerUnresponsive

logger = logging.getLogger("monarch_nb.controller")


class Liveness:
    def __init__(self, mesh: str, state, lose, heartbeat_timeout: float, liveness_timeout):
        if not heartbeat_timeout > 0:
            raise ValueError(f"heartbeat_timeout must be > 0 s, got {heartbeat_timeout!r}")
        if liveness_timeout is not None and not liveness_timeout > 0:
            raise ValueError(f"liveness_timeout must be > 0 s or None, got {liveness_timeout!r}")
        self.mesh = mesh
        self.state = state
        self._lose = lose  # (WorkerUnresponsive) -> None: the mesh cannot go on
        self.heartbeat_timeout = float(heartbeat_timeout)
        self.liveness_timeout = liveness_timeout
        self.listeners: list = []  # callables(event, info): "unresponsive" / "recovered"

    def check(self) -> None:
        """Every tick, on the lease holder's thread."""
        wall = time.time()
        for rank, w in list(self.state.workers.items()):
            if not (w.alive and w.last_seen):
                continue
            silent = wall - w.last_seen
            if self.liveness_timeout is not None and silent > self.liveness_timeout:
                self.state.worker_exited(rank, None)
                self._lose(WorkerUnresponsive(rank, w.host, w.pid, silent, self.mesh))
                continue
            quiet = silent > self.heartbeat_timeout
            if quiet != w.unresponsive:
                w.unresponsive = quiet
                self._tell("unresponsive" if quiet else "recovered", w, silent)

    def _tell(self, event: str, w, silent: float) -> None:
        (logger.warning if event == "unresponsive" else logger.info)(
            "mesh %r: worker rank %d (pid %s on %s) %s",
            self.mesh,
            w.rank,
            w.pid,
            w.host,
            f"silent for {silent:.0f} s" if event == "unresponsive" else "answers again",
        )
        info = {"rank": w.rank, "host": w.host, "pid": w.pid, "silent_for": silent}
        for fn in list(self.listeners):
            try:
                fn(event, info)
            except Exception:
                logger.exception("liveness listener failed")
