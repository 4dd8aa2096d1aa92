"""Cancels: what the request table's cancelled and expired requests leave to do on
the workers, and which failures then need no telling."""

from __future__ import annotations

from ..protocol import encode
from ..protocol import messages as m

KEPT = 4096  # cancelled idents remembered (their late failure reports are not news)


class Cancels:
    def __init__(self, ctrl):
        self._ctrl = ctrl
        self.cancelled: dict[int, None] = {}  # idents the user cancelled (an ordered set)

    def on_cancel(self, req) -> None:
        """The lease holder's part of a cancel handed over: drop ``req``, cancel remotely."""
        self._ctrl.table.pop(req.ident)
        self.cancel_remote(req)

    def cancel_remote(self, req) -> None:
        """Send ``Cancel`` for ``req``'s commands to its live ranks: each stream drops
        them before they start or interrupts them where they run."""
        ctrl = self._ctrl
        for i in req.idents:
            self.cancelled[i] = None
            ctrl.failures.mark_reported(i)
        while len(self.cancelled) > KEPT:
            self.cancelled.pop(next(iter(self.cancelled)))
        alive = [r for r in req.ranks if (w := ctrl.state.workers.get(r)) and w.alive]
        if alive and ctrl.usable:
            ctrl.io.send_to(alive, encode(m.Cancel(tuple(req.idents)), ctrl.signer))
