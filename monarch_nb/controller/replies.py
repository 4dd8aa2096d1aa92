"""What the workers send, handled by the lease holder (the IO thread, or a caller
driving the socket while it waits): one handler per message type,
named after it (as the worker names its handlers after the commands)."""

from __future__ import annotations

import logging
import sys
import traceback

import zmq

from ..protocol import BadMessage, decode, encode, receivers
from ..protocol import messages as m
from ..protocol.agent_link import is_agent_header
from ..protocol.envelope import CONTROLLER, PROTOCOL_VERSION, VersionMismatch, unseal
from ..protocol.receivers import handler_table
from ..protocol.wire import small
from .errors import IOThreadError, RemoteError, sequence_gap
from .hosts import HostLinks

logger = logging.getLogger("monarch_nb.controller")


class Replies:
    """Decodes frames from the ROUTER and updates the controller's parts."""

    def __init__(self, ctrl):
        self.ctrl = ctrl
        self._version_refused: set[bytes] = set()
        self._handlers = handler_table(self, receivers.CONTROLLER)  # fails here if one is missing
        self.hosts = HostLinks(ctrl, self)
        self.on_widget = None  # fn(WidgetMessage) on the IO thread (mesh.widget_handler)

    def on_frames(self, frames) -> None:
        """One ZeroMQ message from a worker socket: its envelope is opened and checked
        against the PeerTable (rank bound to the socket, sequence in order), then each
        message in it is decoded and handled."""
        ctrl = self.ctrl
        identity = frames[0].bytes
        if len(frames) > 2 and is_agent_header(small(frames[2])):
            agents = self._agents()  # a relay's link: the agents' channel reads it
            if agents is not None:
                agents.deliver(frames, _source_fd(frames))
            else:
                self._drop("rank", "an agent link message on a mesh without host agents")
            return
        try:
            header, parts = unseal(frames[1:], ctrl.signer)
            missed = ctrl.peers.admit(identity, header)
        except VersionMismatch as e:
            self._refuse_version(identity, e.version)
            return
        except BadMessage as e:
            self._drop(e.kind, str(e))
            return
        if header.rank < CONTROLLER:  # a host agent's socket: its ranks' traffic
            if missed:
                self._drop("gap", f"{missed} message(s) of host {header.rank} never arrived")
                link = self.hosts.links.get(identity)
                for r in link.ranks if link is not None else ():
                    self.on_gap(r, missed)
            self.hosts.on_envelope(identity, header, parts)
            return
        if missed:
            self._drop("gap", f"{missed} message(s) of rank {header.rank} never arrived")
            self.on_gap(header.rank, missed)
        for p in parts:
            try:
                msg = decode(p, ctrl.signer)
            except BadMessage as e:
                self._drop(e.kind, str(e))
                continue
            self._dispatch(msg, identity, header, joined=missed is not None)

    def on_gap(self, rank: int, missed: int) -> None:
        """``missed`` messages of ``rank`` never arrived: its waiting requests fail."""
        self.ctrl.table.fail_rank(rank, sequence_gap(self.ctrl.name, rank, missed))

    def _dispatch(self, msg, identity: bytes, header, joined: bool) -> None:
        handler = self._handlers.get(type(msg))
        rank = getattr(msg, "rank", None)
        ready = type(msg) in _JOINS  # its handler says why it refuses a bad rank
        if handler is None or not isinstance(rank, int):
            self._drop("malformed", f"an unexpected {type(msg).__name__}")
            return
        if rank != header.rank:
            self._drop(
                "rank", f"a {type(msg).__name__} of rank {rank} sealed by rank {header.rank}"
            )
            return
        if not (joined or ready):  # joined ranks are within the mesh
            self._drop("rank", f"a {type(msg).__name__} of rank {rank}, which has not joined")
            return
        if not ready:
            self.ctrl.state.seen(rank)
        try:
            if ready:
                handler(msg, identity, header)
            elif type(msg) is m.StoreRequest:  # answered on the socket it came from
                handler(msg, identity)
            else:
                handler(msg)
        except Exception as e:
            self._handler_failed(msg, e)

    def _drop(self, kind: str, why: str) -> None:
        n = self.ctrl.peers.count(kind)
        logger.warning(
            "mesh %r dropped a message (%s: %s); %d of that kind so far",
            self.ctrl.name,
            kind,
            why,
            n,
        )

    def _refuse_version(self, identity: bytes, version: int) -> None:
        """A peer of another protocol version: counted, logged, and told once (in
        both languages: a worker's and a relay's, each reads its own)."""
        reason = f"worker speaks protocol {version}, this mesh {PROTOCOL_VERSION}"
        self._drop("version", reason)
        if identity not in self._version_refused and len(self._version_refused) < 4096:
            self._version_refused.add(identity)
            self.ctrl.io.send_now(identity, encode(m.Refused(reason), self.ctrl.signer))
            agents = self._agents()
            if agents is not None:
                agents.refuse_version(identity, version)

    def _agents(self):
        """The host agents' channel of this mesh (``connect_mesh``), or None."""
        return self.ctrl.workers.launcher.agent_channel()

    def _handler_failed(self, msg, e: Exception) -> None:
        """A bug here must not become a silent wait: the request the message answers
        fails with the traceback."""
        name = type(msg).__name__
        logger.exception("mesh %r: handling %s failed", self.ctrl.name, name)
        ident = getattr(msg, "ident", None)
        if isinstance(ident, int):
            tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
            err = IOThreadError(
                f"mesh {self.ctrl.name!r}: the controller failed handling {name} "
                f"from rank {msg.rank} (command {ident}):\n{tb}"
            )
            self.ctrl.table.fail(ident, err)

    # ------------------------------------------------------------ joining

    def WorkerReady(self, msg: m.WorkerReady, identity: bytes, header) -> None:
        ctrl = self.ctrl
        reason = ctrl.workers.admit(msg, identity)
        if reason is not None:
            logger.warning(
                "mesh %r refused a worker (pid %s on %s): %s", ctrl.name, msg.pid, msg.host, reason
            )
            ctrl.io.send_now(identity, encode(m.Refused(reason), ctrl.signer))
            ctrl.peers.refuse(identity, header)
            return
        ctrl.peers.join(identity, header)
        self.hosts.joined()

    def WorkerRejoined(self, msg: m.WorkerRejoined, identity: bytes, header) -> None:
        """A rank of a kept-alive mesh this controller attaches to (rejoin.py); else
        one of its own whose connection dropped and came back: it speaks from there."""
        ctrl = self.ctrl
        if ctrl.workers.rejoined is not None:
            ctrl.workers.rejoined[msg.rank] = msg
            self.WorkerReady(msg, identity, header)
        elif msg.rank in ctrl.workers.identities and ctrl.state.workers[msg.rank].pid == msg.pid:
            ctrl.workers.identities[msg.rank] = identity
            ctrl.peers.join(identity, header)
        else:
            self._drop("rank", f"rank {msg.rank} (pid {msg.pid}) rejoined a mesh it is not of")

    # ------------------------------------------------------------ replies to requests

    def TransferBegin(self, msg: m.TransferBegin) -> None:
        req = self.ctrl.table.get(msg.ident)
        what = req.what if req is not None else "fetch"
        self.ctrl.transfers.begin(msg.ident, msg.rank, msg.nbytes, what)

    def FetchResult(self, msg: m.FetchResult) -> None:
        self.ctrl.transfers.end(msg.ident, msg.rank)
        err = msg.error
        dependent = err.ident if type(err) is m.DependentOn else None
        self.ctrl.table.on_fetch(msg.ident, msg.rank, msg.value, err, dependent)

    def Status(self, msg: m.Status) -> None:
        self.ctrl.state.progress(msg.rank, {msg.stream: msg.progress})
        self.ctrl.table.on_status(msg.ident, msg.rank, msg.stream)

    def RemoteFunctionFailed(self, msg: m.RemoteFunctionFailed) -> None:
        ctrl = self.ctrl
        what = ctrl.state.what_of(msg.stream, msg.ident)
        ctrl.failures.record(msg.ident, msg.rank, msg.failure, what)
        if msg.ident in ctrl.cancels.cancelled:  # the user cancelled it: nothing to tell
            ctrl.failures.mark_reported(msg.ident)
        ctrl.state.add_error(msg.ident, msg.rank, msg.stream, msg.failure)
        ctrl.table.on_failure(msg.ident)

    def StoreRequest(self, msg: m.StoreRequest, identity: bytes) -> None:
        for to, reply in self.ctrl.rendezvous.store.handle(msg, identity):
            self.hosts.reply_to(to, encode(reply, self.ctrl.signer))

    # ------------------------------------------------------------ reports

    def Progress(self, msg: m.Progress) -> None:
        self.ctrl.state.progress(msg.rank, msg.streams)

    def Timings(self, msg: m.Timings) -> None:
        self.ctrl.state.timeline.add(msg.rank, msg.streams)

    def Stalled(self, msg: m.Stalled) -> None:
        self.ctrl.state.stalled(msg.rank, msg.stream, msg.ident, msg.what, msg.seconds, msg.stack)

    def RankGap(self, msg: m.RankGap) -> None:
        """A sequence gap a relay saw on one of its rank's sockets: as one seen here."""
        self._drop("gap", f"{msg.missed} message(s) of rank {msg.rank} never reached its relay")
        self.on_gap(msg.rank, msg.missed)

    def Health(self, msg: m.Health) -> None:
        self.ctrl.state.health(
            msg.rank, msg.rss, msg.cpu, msg.gpu, msg.bad_messages, msg.env_size, msg.rejections
        )

    def Output(self, msg: m.Output) -> None:
        try:
            self.ctrl.on_output(msg)
        except Exception:
            logger.exception("output handler failed")

    def WidgetMessage(self, msg: m.WidgetMessage) -> None:
        fn = self.on_widget
        if fn is None:
            return  # no notebook: a rank's widget has no frontend
        try:
            fn(msg)
        except Exception:
            logger.exception("widget handler failed")

    def DebuggerMessage(self, msg: m.DebuggerMessage) -> None:
        self.ctrl.debugger.on_message(msg)

    def InternalException(self, msg: m.InternalException) -> None:
        ctrl = self.ctrl
        ctrl.state.internal_errors.append({"rank": msg.rank, **msg.failure._asdict()})
        err = RemoteError(
            {msg.rank: tuple(msg.failure)},
            None,
            f"mesh {ctrl.name!r} is broken: an internal error on rank {msg.rank}; restart it",
        )
        ctrl.break_mesh(err)


def _source_fd(frames):
    """The file descriptor a message came in on (which relay's connection), or None."""
    try:
        return frames[1].get(zmq.SRCFD)
    except (zmq.ZMQError, AttributeError, IndexError):
        return None


def print_output(msg: m.Output) -> None:
    """Default output handler (scripts, tests): each line prefixed ``[rank r]``; a
    rank's clear_output() (the output name "clear") clears nothing in a terminal."""
    if msg.name == "clear":
        return
    out = sys.stdout if msg.name == "stdout" else sys.stderr
    text = msg.text
    lines = text.splitlines(keepends=True)
    out.write("".join(f"[rank {msg.rank}] {line}" for line in lines))
    if text and not text.endswith("\n"):
        out.write("\n")
    out.flush()


_JOINS = (m.WorkerReady, m.WorkerRejoined)
