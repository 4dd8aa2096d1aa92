"""A host's one signed socket to its controller: commands come in once per host
and go to the ranks they name; what the ranks send goes out in one envelope per
turn, equal reports of several ranks folded into one record.

Down: a ``HostCommand(targets, count)`` says the next ``count`` messages are for
each of ``targets``. They are verified once here, and each target rank handles
the same decoded record. Up: every rank message of a turn goes in one sealed
batch, in order, except that the Status replies to one RequestStatus, and the
Progress and Health reports of a turn, become one ``Folded`` record per kind
(ranks with equal contents in one group), placed where the last of them was:
a rank's report moves later, never before what it sent earlier.
"""

from __future__ import annotations

import pickle
from collections import deque

import zmq

from .._version import __version__
from ..protocol import BadMessage, Signer, decode, encode
from ..protocol import messages as m
from ..protocol.envelope import (
    CONTROLLER,
    PeerTable,
    Sealer,
    VersionMismatch,
    host_peer,
    open_from_controller,
)
from ..protocol.wire import record_type, recv_ready, send_frames

FOLDED = (m.Status, m.Progress, m.Health)
# templates whose arguments may hold torch's objects (dtypes, devices): never
# unpickled here; the light ranks refuse each use of them (RunOps, CallRecording)
UNREAD = (m.DefineOp, m.DefineRecording)
MAX_BATCH = 512  # messages per envelope at most
MAX_BATCH_BYTES = 256 << 10  # ... and bytes: a socket's send bound then bounds its memory


class HostChannel:
    """The DEALER of host ``host`` (its index in the mesh) to ``address``, signed with ``key``.

    ``ranks`` maps rank -> an object with ``handle(msg)`` (the host's ranks, filled by
    the agent); ``on_refused(reason)`` is called when the controller refuses the host."""

    def __init__(
        self, ctx, address: str, key: bytes, host: int, pid: int, name: str, sndhwm: int = 0
    ):
        self.address, self.host = address, host
        self.signer = Signer(key)
        self.sealer = Sealer(self.signer, host_peer(host))
        self.peers = PeerTable()
        self.peers.allow(CONTROLLER)
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.SNDHWM, sndhwm)  # envelopes on their way, at most (0: any)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(address)
        self.backlog: deque = deque()  # sealed envelopes the socket could not take yet
        self.ranks: dict = {}
        self.outbox: list = []
        self.refused: str | None = None
        self._targets: tuple = ()  # what the current HostCommand names
        self._left = 0  # messages it still covers
        self.post(m.HostJoin(host, pid, name, __version__))
        self.flush()

    def post(self, msg) -> None:
        """Queue a message of a rank (or of the host) for the next flush."""
        self.outbox.append(msg)

    # ------------------------------------------------------------ down

    def receive(self) -> list:
        """Handle what waits on the socket (at most 256 envelopes); returns the ranks
        that handled something."""
        touched: list = []
        for _ in range(256):
            frames = recv_ready(self.sock)
            if frames is None:
                break
            self._envelope(frames, touched)
        return touched

    def _envelope(self, frames, touched: list) -> None:
        try:
            missed, parts = open_from_controller(frames, self.signer, self.peers)
        except VersionMismatch as e:
            self.refused = f"the controller speaks protocol {e.version}: not this version"
            return
        except BadMessage as e:
            self.peers.count(e.kind)
            return
        if missed:
            self.peers.count("gap")
        for p in parts:
            self._part(p, touched)

    def _part(self, p, touched: list) -> None:
        """One message of an envelope: decoded once, handled for every target."""
        if len(p) == 2 and record_type(p[1]) in UNREAD:
            if self._left:
                self._left -= 1
            return
        try:
            msg = decode(p, self.signer)
        except BadMessage as e:
            self.peers.count(e.kind)
            if self._left:
                self._left -= 1
            return
        self._message(msg, touched)

    def _message(self, msg, touched: list) -> None:
        if self._left:
            self._left -= 1
            for r in self._targets:
                rank = self.ranks.get(r)
                if rank is not None:
                    rank.handle(msg)
            touched.extend(self._targets)
            return
        t = type(msg)
        if t is m.HostCommand:
            self._targets, self._left = tuple(msg.targets), int(msg.count)
        elif t is m.Refused:
            self.refused = msg.reason
        elif t is not m.Ping:
            self.peers.count("malformed")

    # ------------------------------------------------------------ up

    def flush(self) -> None:
        """Send what the ranks posted since the last flush, folded."""
        self.drain()
        out = self.outbox
        if not out:
            return
        self.outbox = []
        frames: list = []
        n = size = 0
        for msg in _folded(out):
            enc = msg if type(msg) is list else encode(msg, self.signer)
            if len(enc) != 2:  # a message with buffers travels alone
                n = self._send(frames, n)
                self._out(self.sealer.seal(enc))
                continue
            frames += enc
            n += 1
            size += len(enc[1])
            if n >= MAX_BATCH or size >= MAX_BATCH_BYTES:
                n = self._send(frames, n)
                size = 0
        self._send(frames, n)

    def _send(self, frames: list, n: int) -> int:
        if n:
            self._out(self.sealer.seal(list(frames), n))
            frames.clear()
        return 0

    def _out(self, sealed: list) -> None:
        """Send one sealed envelope, or keep it (after those kept before) while the
        socket is at its send bound."""
        if not self.backlog:
            try:
                send_frames(self.sock, sealed, nowait=True)
                return
            except zmq.Again:
                pass
        self.backlog.append(sealed)

    def drain(self) -> bool:
        """Send the kept envelopes the socket takes now; True when none is left."""
        q = self.backlog
        while q:
            try:
                send_frames(self.sock, q[0], nowait=True)
            except zmq.Again:
                return False
            q.popleft()
        return True

    def close(self) -> None:
        self.sock.close(linger=0)


def _folded(out: list) -> list:
    """``out`` with each kind of report (Status per ident) folded into one record at
    the place of its last message; a kind with one message stays as it is."""
    groups: dict = {}
    last: dict = {}
    for i, msg in enumerate(out):
        t = type(msg)
        if t in FOLDED:
            key = (t, msg.ident) if t is m.Status else t
            groups.setdefault(key, []).append(msg)
            last[key] = i
    if not groups:
        return out
    result = []
    for i, msg in enumerate(out):
        t = type(msg)
        if t not in FOLDED:
            result.append(msg)
            continue
        key = (t, msg.ident) if t is m.Status else t
        if last[key] != i:
            continue
        msgs = groups[key]
        result.append(msgs[0] if len(msgs) == 1 else fold(msgs))
    return result


def fold(msgs: list) -> m.Folded:
    """Messages of one type (with ``rank`` as their first field) as one Folded record."""
    by_content: dict = {}
    for msg in msgs:
        fields = tuple(msg[1:])
        key = pickle.dumps(fields, 5)
        g = by_content.get(key)
        if g is None:
            by_content[key] = ([msg[0]], fields)
        else:
            g[0].append(msg[0])
    return m.Folded(type(msgs[0]).__name__, tuple((tuple(r), f) for r, f in by_content.values()))
