"""The fan-out of a real host: the relay's one socket to the mesh's ROUTER
(``fanout.HostChannel``, joined as host ``h``) and its ranks' ROUTER
(``relay_ranks.RankSockets``) on either side.

Down: a ``HostCommand(targets, count)`` and its messages arrive once for the
host; each message goes to each target's socket, in order, as the frames it
came in (never unpickled here). Up: what the ranks send goes out in the host's
envelopes, in arrival order, the Status replies to one RequestStatus and the
Progress and Health reports of a turn folded (``fanout._folded``). The Status
replies of a host's ranks come microseconds apart: once one rank has answered a
RequestStatus, the outbox waits (at most ``HOLD_S``) for the others, so that
they fold into one record.
"""

from __future__ import annotations

import os
import time

from ..protocol import BadMessage, Signer
from ..protocol import messages as m
from ..protocol.wire import record_type
from .fanout import HostChannel
from .relay_ranks import RankSockets, decode_plain

UP_HWM = 16  # envelopes (of at most 256 KB of small messages) on their way up, at most
HOLD_S = 0.002  # how long the outbox waits for the other ranks' Status of a RequestStatus
FORGET_S = 60.0  # a RequestStatus none of whose ranks answered: forgotten after this
KEPT_BYTES = 8 << 20  # the ranks' output a relay keeps across a lost controller, at most


class RelayHost(HostChannel):
    """Host ``host`` of the mesh at ``address``: ranks ``first`` .. ``first + count - 1``
    of this host connect to ``self.ranks.address`` (an ipc socket; in ``directory``
    when it is where they connected before: they rejoin)."""

    def __init__(
        self, ctx, address: str, key: bytes, host: int, first: int, count: int, name,
        directory: str | None = None,
    ):  # fmt: skip
        self._expect: dict = {}  # RequestStatus ident -> [ranks to answer, hold deadline, made]
        self.holding = False  # the controller's connection closed: nothing leaves meanwhile
        self._kept: list = []  # the ranks' output from before, sent once they all rejoined
        self._rejoins_left = 0
        self.rank_sockets = RankSockets(ctx, Signer(key), first, count, directory)
        self.first, self.count = first, count
        super().__init__(ctx, address, key, host, os.getpid(), name, sndhwm=UP_HWM)

    @property
    def ranks_address(self) -> str:
        return self.rank_sockets.address

    def close(self, keep_dir: bool = False) -> None:
        super().close()
        self.rank_sockets.close(keep_dir)

    # ------------------------------------------------------------ down

    def receive(self) -> list:
        touched = super().receive()
        self.rank_sockets.flush()
        return touched

    def _part(self, p, touched: list) -> None:
        cls = record_type(p[1]) if len(p) == 2 else None
        if not self._left:  # the controller's own records: HostCommand, Refused, Ping
            if cls is m.Ping:
                self.rank_sockets.ping(p)
            else:
                super()._part(p, touched)
            return
        self._left -= 1
        if cls is m.RequestStatus:
            try:
                ident = decode_plain(p, self.signer, m.RequestStatus).ident
            except BadMessage as e:
                self.peers.count(e.kind)
                return
            self._expect[ident] = [set(self._targets), None, time.monotonic()]
        self.rank_sockets.deliver(self._targets, p)

    # ------------------------------------------------------------ up

    def from_ranks(self) -> None:
        """Take in what the ranks sent (sent on by the next ``flush``)."""
        self.rank_sockets.receive(self._up)

    def kept_output(self) -> list:
        """The ranks' Output not sent yet (the newest ``KEPT_BYTES``): a kept-alive
        mesh's relay holds it for the controller that attaches."""
        out = [p for p in self.outbox if type(p) is list and len(p) == 2 and record_type(p[1]) is m.Output]
        size = 0
        for i in range(len(out) - 1, -1, -1):
            size += len(out[i][1])
            if size > KEPT_BYTES:
                return out[i + 1 :]
        return out

    def send_after_rejoins(self, parts: list) -> None:
        """Send ``parts`` once each of this host's ranks said WorkerRejoined (before
        that the controller would drop what they say)."""
        self._kept, self._rejoins_left = parts, self.count

    def _up(self, msg) -> None:
        if self._rejoins_left and type(msg) is list and record_type(msg[1]) is m.WorkerRejoined:
            self._rejoins_left -= 1
            if not self._rejoins_left:
                self.outbox.append(msg)
                self.outbox += self._kept
                self._kept = []
                return
        if type(msg) is m.Status:
            e = self._expect.get(msg.ident)
            if e is not None:
                e[0].discard(msg.rank)
                if not e[0]:
                    del self._expect[msg.ident]
                elif e[1] is None:
                    e[1] = time.monotonic() + HOLD_S
        self.outbox.append(msg)

    def hold_left(self) -> float | None:
        """Seconds the outbox still waits for the other ranks' Status (None: it does not)."""
        if not self._expect:
            return None
        now = time.monotonic()
        left = None
        for ident, (_, until, made) in list(self._expect.items()):
            if until is None:
                if now - made > FORGET_S:
                    del self._expect[ident]
            elif until <= now:
                del self._expect[ident]  # a rank that is slow or gone: send what is in
            else:
                left = until - now if left is None else min(left, until - now)
        return left

    def flush(self) -> None:
        if self.outbox and self.hold_left() is None and not self.holding:
            super().flush()
