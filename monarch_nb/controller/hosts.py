"""Host links: hosts that carry their ranks' traffic over one socket (the fan-out).

A host joins with ``HostJoin`` (sealed as ``envelope.host_peer(host)``); the mesh's
launcher says which ranks it serves (``launcher.host_ranks(host, pid)``). After
that, its ranks join through it (their WorkerReady inside its envelopes), the IO
loop sends each command once per host (``HostCommand``), and what the host sends
is its ranks' messages, each checked against the ranks it serves, and ``Folded``
records, handled a group at a time (``Status`` and ``Progress`` of many ranks in
one step, not a dict update per rank). What answers a rank's socket rather than
the rank (a ``StoreReply``) goes through its host too: ``reply_to`` takes the
(host identity, rank) a hosted rank's request was remembered as.
"""

from __future__ import annotations

import logging
import time

from .._version import __version__
from ..protocol import BadMessage, decode, encode
from ..protocol import messages as m
from ..protocol.envelope import host_peer

logger = logging.getLogger("monarch_nb.controller")

_TYPES = {
    c.__name__: c
    for c in vars(m).values()
    if isinstance(c, type) and issubclass(c, tuple) and c.__module__ == m.__name__
}


class HostLink:
    """One joined host: its index, its ranks, its process and name."""

    __slots__ = ("host", "ranks", "pid", "name", "identity")

    def __init__(self, host: int, ranks, pid: int, name: str, identity: bytes):
        self.host, self.ranks, self.pid, self.name = host, ranks, pid, name
        self.identity = identity


class HostLinks:
    """The joined hosts of a mesh, and the handling of what they send (the lease holder)."""

    def __init__(self, ctrl, replies):
        self.ctrl, self.replies = ctrl, replies
        self.links: dict[bytes, HostLink] = {}  # socket identity -> link

    def on_envelope(self, identity: bytes, header, parts) -> None:
        """An opened envelope from a host socket: a HostJoin first, then its ranks'."""
        ctrl = self.ctrl
        link = self.links.get(identity)
        for p in parts:
            try:
                msg = decode(p, ctrl.signer)
            except BadMessage as e:
                self.replies._drop(e.kind, str(e))
                continue
            if link is None:
                if type(msg) is m.HostJoin:
                    link = self._join(msg, identity, header)
                else:
                    self.replies._drop(
                        "rank", f"a {type(msg).__name__} of a host that has not joined"
                    )
                continue
            try:
                if type(msg) is m.Folded:
                    self._folded(msg, link)
                else:
                    self._rank_message(msg, link)
            except Exception as e:
                self.replies._handler_failed(msg, e)

    # ------------------------------------------------------------ joining

    def _join(self, msg: m.HostJoin, identity: bytes, header) -> HostLink | None:
        ctrl = self.ctrl
        ranks = ctrl.workers.launcher.host_ranks(msg.host, msg.pid)
        reason = None
        if msg.version != __version__:
            reason = f"host agent runs monarch_nb {msg.version}, this controller {__version__}"
        elif header.rank != host_peer(msg.host):
            reason = f"host {msg.host} sealed as peer {header.rank}"
        elif ranks is None:
            reason = f"host {msg.host} ({msg.name}, pid {msg.pid}) is not a host of this mesh"
        elif any(li.host == msg.host and li.pid == msg.pid for li in self.links.values()):
            reason = f"host {msg.host} has joined already"
        if reason is not None:
            logger.warning("mesh %r refused a host agent: %s", ctrl.name, reason)
            ctrl.io.send_now(identity, encode(m.Refused(reason), ctrl.signer))
            ctrl.peers.refuse(identity, header)
            return None
        for old, li in list(self.links.items()):  # the launcher replaced that host
            if li.host == msg.host:
                del self.links[old]
                ctrl.io.routes.drop_host(old)
        ctrl.peers.join(identity, header)
        link = HostLink(msg.host, frozenset(ranks), msg.pid, msg.name, identity)
        self.links[identity] = link
        ctrl.io.routes.add_host(identity)
        return link

    # ------------------------------------------------------------ its ranks

    def _rank_message(self, msg, link: HostLink) -> None:
        ctrl, replies = self.ctrl, self.replies
        rank = getattr(msg, "rank", None)
        handler = replies._handlers.get(type(msg))
        if handler is None or not isinstance(rank, int):
            replies._drop("malformed", f"an unexpected {type(msg).__name__}")
            return
        if rank not in link.ranks:
            replies._drop("rank", f"a {type(msg).__name__} of rank {rank} from host {link.host}")
            return
        if type(msg) is m.WorkerRejoined:
            if ctrl.workers.rejoined is None:
                return  # one of ours whose socket to its host came back: nothing changed here
            ctrl.workers.rejoined[msg.rank] = msg  # a kept-alive mesh's rank, to us (rejoin.py)
        if type(msg) is m.WorkerReady or type(msg) is m.WorkerRejoined:
            reason = ctrl.workers.admit(msg, link.identity)
            if reason is not None:
                logger.warning(
                    "mesh %r refused rank %s on %s: %s", ctrl.name, rank, link.name, reason
                )
                ctrl.io.send_via_host(
                    link.identity, (rank,), encode(m.Refused(reason), ctrl.signer)
                )
            else:
                self.joined()
            return
        if ctrl.workers.identities.get(rank) != link.identity:
            replies._drop("rank", f"a {type(msg).__name__} of rank {rank}, which has not joined")
            return
        ctrl.state.seen(rank)
        if type(msg) is m.StoreRequest:  # answered through the host, which knows the socket
            handler(msg, (link.identity, rank))
        else:
            handler(msg)

    def joined(self) -> None:
        """A rank joined: where each rank's messages go may have changed (a rank
        direct in the last generation and hosted in this one, or the other way), so
        the routes make their cached splits again (a new epoch; the same hosts)."""
        self.ctrl.io.routes.changed()

    def reply_to(self, to, frames) -> None:
        """Send one buffer-less message to a socket a request came from: a worker's
        identity, or (host identity, rank) for a rank served by a host."""
        if type(to) is tuple:
            self.ctrl.io.send_via_host(to[0], (to[1],), frames)
        else:
            self.ctrl.io.send_now(to, frames)

    def _folded(self, msg: m.Folded, link: HostLink) -> None:
        cls = _TYPES.get(msg.kind)
        if cls is None or cls not in self.replies._handlers:
            self.replies._drop("malformed", f"a fold of {msg.kind!r}")
            return
        joined = self.ctrl.workers.identities
        me = link.identity
        now = time.time()
        state = self.ctrl.state
        for ranks, fields in msg.groups:
            get = joined.get
            if link.ranks.issuperset(ranks):
                ok = [r for r in ranks if get(r) is me]
            else:
                ok = [r for r in ranks if r in link.ranks and get(r) is me]
            if len(ok) != len(ranks):
                self.replies._drop(
                    "rank", f"a fold of {msg.kind} naming ranks not of host {link.host}"
                )
            if not ok:
                continue
            state.seen_many(ok, now)
            if cls is m.Status:
                stream, ident, progress = fields
                state.progress_many(ok, {stream: progress})
                self.ctrl.table.on_status_many(ident, ok, stream)
            elif cls is m.Progress:
                state.progress_many(ok, fields[0])
            else:
                handler = self.replies._handlers[cls]
                for r in ok:
                    handler(cls(r, *fields))
