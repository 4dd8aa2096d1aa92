"""Interrupting running commands, and knowing whether they stopped."""

from __future__ import annotations

import time

from .. import config
from ..protocol import messages as m
from .errors import InterruptTimeout


def running(state, streams=(), ranks=None) -> dict:
    """(rank, stream id) -> (ident, what) of the commands running now, as reported."""
    out = {}
    with state.lock:
        for r, w in state.workers.items():
            if not w.alive or (ranks is not None and r not in ranks):
                continue
            for sid, (started, finished, _) in w.progress.items():
                if started > finished and (not streams or sid in streams):
                    out[(r, sid)] = started
    return {k: (i, state.what_of(k[1], i)) for k, i in out.items()}


def wait_stopped(state, mesh: str, was_running: dict, timeout: float) -> None:
    """Wait up to ``timeout`` s for the commands of ``was_running`` to end; raise
    InterruptTimeout naming the ranks (and commands) that did not: they are stuck
    outside Python code and only ``restart()`` frees them."""
    left = dict(was_running)
    deadline = time.monotonic() + timeout
    while left:
        with state.lock:
            for (r, sid), (ident, _) in list(left.items()):
                w = state.workers.get(r)
                if w is None or not w.alive or w.progress.get(sid, (0, 0, 0))[1] >= ident:
                    del left[(r, sid)]
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if left:
        stuck: dict = {}
        for (r, sid), (ident, what) in sorted(left.items()):
            name = state.stream_names.get(sid, str(sid))
            stuck.setdefault(r, []).append((name, ident, what))
        raise InterruptTimeout(stuck, timeout, mesh)


class Interrupts:
    """Interrupting the commands of one controller's mesh."""

    def __init__(self, ctrl):
        self._ctrl = ctrl

    def interrupt(self, streams=(), ranks=None) -> None:
        """Raise KeyboardInterrupt in the running commands of these streams (all by
        default) on ``ranks`` (all by default). The live workers of a broken mesh
        are interrupted too."""
        ctrl = self._ctrl
        if not (ctrl.closed or ctrl._closing):
            alive = [
                r
                for r, w in ctrl.state.workers.items()
                if w.alive and (ranks is None or r in ranks)
            ]
            ctrl.send(m.Interrupt(tuple(streams), ctrl.next_ident()), alive, check=False)

    def interrupt_and_wait(self, streams=(), timeout: float | None = None, ranks=None) -> None:
        """Interrupt (on ``ranks``, all by default), then wait up to ``timeout`` s (the
        setting ``interrupt_wait`` by default) for the commands that were running to
        end (InterruptTimeout names those that did not: only ``restart()`` frees them)."""
        state = self._ctrl.state
        was_running = running(state, streams, ranks)
        self.interrupt(streams, ranks)
        if timeout is None:  # read after the interrupt is on its way
            timeout = config.setting("interrupt_wait")
        wait_stopped(state, self._ctrl.name, was_running, timeout)

    def after_ctrl_c(self) -> None:
        """Ctrl-C while a caller waited: interrupt every running command and wait up
        to ``interrupt_wait`` s for them to stop (a KeyboardInterrupt naming stuck ranks)."""
        try:
            self.interrupt_and_wait()
        except InterruptTimeout as e:
            raise KeyboardInterrupt(str(e)) from None
