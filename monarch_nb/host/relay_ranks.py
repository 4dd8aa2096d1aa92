"""The relay's side of its ranks: a ROUTER on an ``ipc://`` socket in a private
(0700) directory, where the forked ranks connect as if it were the controller.

Each rank opens several sockets to "the controller": its receiver (the first,
which says WorkerReady), one per stream for replies, one per thread for the
process-group store. Every envelope is verified here (the mesh key, a
``PeerTable`` of the ranks' sockets); what goes to a rank is sealed as
``CONTROLLER`` by the relay's own ``Sealer``. Commands go to a rank's receiver;
a ``StoreReply`` goes back to the socket its ``StoreRequest`` came on.

Messages are not unpickled to be passed on: the type of a record is read from
its first pickle opcodes (``record_type``). Only the few records the relay acts
on, all plain data, are decoded (StoreRequest, Status, Progress, Health up;
RequestStatus, StoreReply down), by an unpickler that loads no class but the
protocol's (``decode_plain``: the relay never imports torch or a user's module);
a WorkerReady (its versions hold torch's version object) counts as the rank its
envelope is sealed by. A user's values (a FetchResult, a SendTensor) pass as the
frames they came in, their buffers never copied.

A relay killed with SIGKILL leaves its directory behind; the next relay of this
user on the host removes it (``sweep_stale``), unless the relay that made it
(its ``owner`` file) still runs: a kept-alive mesh's relay closes the socket
while no controller is there and binds it again where it was.
"""

from __future__ import annotations

import glob
import io
import logging
import os
import pickle
import shutil
import socket
import stat
import tempfile
import time
from collections import OrderedDict

import zmq

from ..protocol import BadMessage, keepalive
from ..protocol import messages as m
from ..protocol.constants import RECV_HWM
from ..protocol.envelope import CONTROLLER, PeerTable, Sealer, VersionMismatch, unseal
from ..protocol.wire import build, record_type, recv_ready, send_frames

logger = logging.getLogger("monarch_nb.host")

DECODED_UP = (m.StoreRequest, m.Status, m.Progress, m.Health)
MAX_STORE_WAITS = 4096  # store requests remembered for their replies at most
PREFIX = "mnb-relay-"
YOUNG_S = 60.0  # a directory without a socket yet this young is still being made


def sweep_stale(root: str | None = None) -> list:
    """Remove this user's relay directories under ``root`` (the temp dir) whose
    socket nobody listens on any more; returns them."""
    gone = []
    for d in glob.glob(os.path.join(root or tempfile.gettempdir(), PREFIX + "*")):
        try:
            st = os.lstat(d)
        except OSError:
            continue
        if st.st_uid != os.getuid() or not stat.S_ISDIR(st.st_mode):
            continue
        path = os.path.join(d, "ranks")
        if _owner_runs(d):
            continue
        if os.path.exists(path):
            if _listened(path):
                continue
        elif time.time() - st.st_mtime < YOUNG_S:
            continue
        shutil.rmtree(d, ignore_errors=True)
        gone.append(d)
    return gone


def _owner_runs(d: str) -> bool:
    try:
        with open(os.path.join(d, "owner")) as f:
            return keepalive.process_runs(int(f.read()))
    except (OSError, ValueError):
        return False


def _listened(path: str) -> bool:
    """Whether a process accepts connections on the Unix socket ``path``."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(1.0)
        s.connect(path)
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:  # cannot tell: keep it
        return True
    finally:
        s.close()


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module == m.__name__:
            return getattr(m, name)
        raise pickle.UnpicklingError(f"{module}.{name} in a record the relay reads")


def decode_plain(p, signer, cls: type):
    """Record ``cls`` of the frames ``p`` (``[sig, pickle]``, sig None: covered by its
    envelope), verified; BadMessage when it does not verify, or holds anything but
    plain data and the protocol's records."""
    payload = p[1].bytes if hasattr(p[1], "bytes") else bytes(p[1])
    if p[0] is not None and not signer.verify(bytes(p[0]), payload, ()):
        raise BadMessage("signature does not verify", "signature")
    try:
        flat = _PlainUnpickler(io.BytesIO(payload)).load()
    except Exception as e:
        raise BadMessage(f"a {cls.__name__} the relay cannot read: {e}") from e
    if type(flat) is not tuple:
        raise BadMessage(f"not a {cls.__name__} record")
    return build(cls, flat)


class RankSockets:
    """The ROUTER the ranks of ``first`` .. ``first + count - 1`` connect to; bound
    in ``directory`` when they connected there before (they rejoin, each socket
    where it is in its sequence)."""

    def __init__(self, ctx, signer, first: int, count: int, directory: str | None = None):
        self.signer = signer
        self.first, self.count = first, count
        rejoin = directory is not None
        if directory is None:
            for d in sweep_stale():
                logger.info("removed %s, the directory of a relay that is gone", d)
            directory = tempfile.mkdtemp(prefix=PREFIX)  # mode 0700: this user only
            os.chmod(directory, 0o700)
            with open(os.path.join(directory, "owner"), "w") as f:
                f.write(str(os.getpid()))
        self.dir = directory
        self.address = f"ipc://{self.dir}/ranks"
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, RECV_HWM)
        self.sock.bind(self.address)
        self.sealer = Sealer(signer, CONTROLLER)
        self.peers = PeerTable()
        self.receivers: dict[int, bytes] = {}  # rank -> its receiver socket's identity
        self.store_waits: OrderedDict = OrderedDict()  # (rank, request) -> identity
        self._down: dict[bytes, list] = {}  # identity -> [sig, pickle] pairs to send
        if rejoin:
            self.peers.resume(range(first, first + count))

    def close(self, keep_dir: bool = False) -> None:
        self.sock.close(linger=0)
        if not keep_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------ up (ranks -> relay)

    def receive(self, post) -> int:
        """Read what the ranks sent (at most 1,000 envelopes); ``post(msg)`` each
        message for the controller, in arrival order (a decoded record, or the
        frames of one passed on). Returns how many envelopes were read."""
        n = 0
        for n in range(1, 1001):
            frames = recv_ready(self.sock)
            if frames is None:
                return n - 1
            self._envelope(frames, post)
        return n

    def _envelope(self, frames, post) -> None:
        identity = frames[0].bytes
        try:
            header, parts = unseal(frames[1:], self.signer)
            missed = self.peers.admit(identity, header)
        except VersionMismatch:
            self.peers.count("version")  # the same release forked it: cannot happen
            return
        except BadMessage as e:
            self._drop(e.kind, e)
            return
        if missed:  # the controller fails what waits on that rank, as for its own sockets
            self._drop("gap", f"{missed} message(s) of rank {header.rank} never arrived")
            post(m.RankGap(header.rank, missed))
        for p in parts:
            cls = record_type(p[1]) if len(p) == 2 else None
            if cls is m.WorkerReady or cls is m.WorkerRejoined:
                if self._ready(header.rank, identity, header):
                    missed = 0
                    post(p)
                continue
            if missed is None:
                self._drop("rank", f"a message of rank {header.rank}, which has not joined")
                continue
            if cls not in DECODED_UP:
                post(p)
                continue
            try:
                msg = decode_plain(p, self.signer, cls)
            except BadMessage as e:
                self._drop(e.kind, e)
                continue
            if msg.rank != header.rank:
                self._drop("rank", f"a {cls.__name__} of rank {msg.rank} sealed by {header.rank}")
                continue
            if cls is m.StoreRequest:
                self._remember_store(msg.rank, msg.request, identity)
            post(p if cls is m.StoreRequest else msg)

    def _ready(self, rank: int, identity: bytes, header) -> bool:
        """A rank's receiver says WorkerReady: commands for the rank go to it."""
        if not self.first <= rank < self.first + self.count:
            self._drop("rank", f"rank {rank} is not one of this host's")
            self.peers.refuse(identity, header)
            return False
        self.peers.join(identity, header)
        self.receivers[rank] = identity
        for k in [k for k in self.store_waits if k[0] == rank]:  # an earlier process's
            del self.store_waits[k]
        return True

    def _remember_store(self, rank: int, request: int, identity: bytes) -> None:
        waits = self.store_waits
        waits[(rank, request)] = identity
        while len(waits) > MAX_STORE_WAITS:  # requests whose replies never came
            waits.popitem(last=False)

    def _drop(self, kind: str, why) -> None:
        n = self.peers.count(kind)
        logger.warning("the relay dropped a rank's message (%s: %s); %d so far", kind, why, n)

    # ------------------------------------------------------------ down (relay -> ranks)

    def deliver(self, targets, p) -> None:
        """Queue one message from the controller for each of ``targets`` (ranks): on
        its receiver, a StoreReply on the socket that asked. Sent by ``flush``."""
        cls = record_type(p[1]) if len(p) == 2 else None
        if cls is m.StoreReply:
            self._store_reply(targets, p)
            return
        for r in targets:
            identity = self.receivers.get(r)
            if identity is None:
                self._drop("rank", f"a message for rank {r}, which has not joined here")
            elif len(p) == 2:
                q = self._down.get(identity)
                if q is None:
                    self._down[identity] = list(p)
                else:
                    q += p
            else:  # with buffers: alone, after what was queued for that socket
                self._send(identity)
                send_frames(self.sock, [identity, *self.sealer.seal(p, 1, identity)])

    def _store_reply(self, targets, p) -> None:
        try:
            reply = decode_plain(p, self.signer, m.StoreReply)
        except BadMessage as e:
            self._drop(e.kind, e)
            return
        for r in targets:
            identity = self.store_waits.pop((r, reply.request), None)
            if identity is None:
                self._drop("rank", f"a store reply for rank {r} that asked nothing here")
                continue
            self._send(identity)
            send_frames(self.sock, [identity, *self.sealer.seal(p, 1, identity)])

    def ping(self, p) -> None:
        """A Ping of the controller: to every receiver (a joined rank hears it is there)."""
        for identity in self.receivers.values():
            q = self._down.get(identity)
            if q is None:
                self._down[identity] = list(p)
            else:
                q += p

    def flush(self) -> None:
        """Send what ``deliver`` queued: one envelope per socket."""
        for identity in list(self._down):
            self._send(identity)

    def _send(self, identity: bytes) -> None:
        q = self._down.pop(identity, None)
        if q:
            send_frames(self.sock, [identity, *self.sealer.seal(q, len(q) // 2, identity)])
