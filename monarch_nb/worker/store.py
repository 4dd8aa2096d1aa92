"""The workers' torch.distributed store: on one host a FileStore (no socket at
all); otherwise the controller's store (controller/store_server.py), reached only
through the signed controller channel, so that nothing of the mesh listens for
the rendezvous.

Each thread that uses the store (the default stream joining the default group,
the process-group set-up thread, a stream whose first NCCL collective makes its
communicator, torch's own threads) gets its own DEALER to the controller, and
waits for its reply on it: concurrent callers never wait on one another (a get
parked in the controller for one thread cannot hold up another's set), and no
reply waits for the receiver thread's poll. A request is one StoreRequest; its
StoreReply carries the generation and the request's number: any other reply (a
late answer to a request that timed out, a dead generation's) is dropped.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import threading
import time

import torch.distributed as dist

from ..hooks import Hook
from ..protocol import BadMessage, encode, held_dirs
from ..protocol import messages as m
from ..protocol.envelope import CONTROLLER, PeerTable, Sealer, decode_each, open_from_controller
from ..protocol.wire import recv_ready, send_frames

logger = logging.getLogger("monarch_nb.worker")

FILE = "file://"
CONTROLLER_STORE = "controller://"
CURRENT_STORE = Hook("current_store", "this worker's store, as its InitBackend opened it")
HELD: list = []  # this process's holds on its rendezvous directories (see controller/rendezvous)


class StoreTimeout(dist.DistStoreError):
    """A store operation got no answer within its bound."""


class ControllerStoreError(dist.DistStoreError):
    """The controller refused a store operation (the reason is the message)."""


def open_store(address: str, world: int, link, timeout: datetime.timedelta):
    """The store of InitBackend's ``address``: ``file:///path`` or ``controller://G``
    (generation G, reached through ``link``: the Worker)."""
    if address.startswith(FILE):
        path = address[len(FILE) :]
        HELD.append(held_dirs.hold(os.path.dirname(path)))  # for this process's life
        store = dist.FileStore(path, world)
    elif address.startswith(CONTROLLER_STORE):
        if link is None:
            raise ValueError("the controller's store needs the worker's connection")
        store = ControllerStore(link, int(address[len(CONTROLLER_STORE) :]), timeout)
    else:
        raise ValueError(
            f"unknown rendezvous address {address!r}: a controller of another "
            "monarch_nb version? (expected file:// or controller://)"
        )
    CURRENT_STORE.install(store)
    return store


def current_store():
    """This worker's store (as opened by its InitBackend), or None."""
    return CURRENT_STORE.value


class _Channel:
    """One thread's DEALER to the controller, with its own seal and its own
    record of the controller's sequence numbers."""

    def __init__(self, link):
        self.sock = link.connect_socket()
        self.signer = link.signer
        self.sealer = Sealer(link.signer, link.rank)
        self.peers = PeerTable(link.peers.rejections)  # drops count with the worker's
        self.peers.allow(CONTROLLER)
        self._link, self._reconnects = link, link.reconnects

    def send(self, msg) -> None:
        if self._link.reconnects != self._reconnects:  # a controller attached: its socket is new
            self._reconnects = self._link.reconnects
            self.peers.release(b"")
        send_frames(self.sock, self.sealer.seal(encode(msg, self.signer)))

    def replies(self, deadline: float):
        """The StoreReplies arriving until ``deadline`` (monotonic)."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if not self.sock.poll(max(1, int(left * 1000))):
                continue
            while (frames := recv_ready(self.sock)) is not None:
                yield from self._open(frames)

    def _open(self, frames):
        try:
            _, parts = open_from_controller(frames, self.signer, self.peers)
        except BadMessage as e:
            self._drop(e.kind, e)
            return
        for msg in decode_each(parts, self.signer):
            if isinstance(msg, BadMessage):
                self._drop(msg.kind, msg)
            elif type(msg) is m.StoreReply:
                yield msg
            else:
                self._drop("malformed", f"a {type(msg).__name__} on the store's socket")

    def _drop(self, kind: str, why) -> None:
        self.peers.count(kind)
        logger.warning("the store dropped a message (%s: %s)", kind, why)


class ControllerStore(dist.Store):
    """A torch.distributed store whose keys the controller keeps (one dict per
    generation). Every operation is bounded by the store's timeout (``set_timeout``
    changes it; ``wait`` takes its own; 0, torch's "none", is the first timeout
    again): past it, StoreTimeout."""

    def __init__(self, link, generation: int, timeout: datetime.timedelta):
        super().__init__()
        self.set_timeout(timeout)
        self._bound = timeout.total_seconds() or 300.0
        self._link = link  # connect_socket(), signer, rank, peers: the Worker
        self.generation = generation
        self._local = threading.local()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def _channel(self) -> _Channel:
        ch = getattr(self._local, "channel", None)
        if ch is None:
            with self._lock:  # sockets are made from the worker's one context
                ch = self._local.channel = _Channel(self._link)
        return ch

    def _call(self, op: str, args: tuple, timeout: datetime.timedelta | None = None):
        # torch's "no timeout" (0) is bounded here too: by the timeout the store began with
        bound = (timeout or self.timeout).total_seconds() or self._bound
        ch = self._channel()
        request = next(self._ids)
        ch.send(m.StoreRequest(self._link.rank, self.generation, request, op, args, bound))
        for reply in ch.replies(time.monotonic() + bound):
            if reply.generation != self.generation or reply.request != request:
                continue  # a late answer to an earlier request, or of another generation
            if reply.error is not None:
                raise ControllerStoreError(f"store {op}: {reply.error}")
            return reply.value
        if op in ("get", "wait", "multi_get"):
            keys = args[0] if op != "get" else [args[0]]
            raise StoreTimeout(
                f"store {op} timed out after {bound:g} s: key(s) {list(keys)} not set "
                f"(generation {self.generation}, rank {self._link.rank}; did every rank join?)"
            )
        raise StoreTimeout(
            f"store {op} timed out after {bound:g} s: the controller did not answer "
            f"(generation {self.generation}, rank {self._link.rank})"
        )

    # ------------------------------------------------------------ torch's Store API

    def set(self, key, value) -> None:
        self._call("set", (str(key), _bytes(value)))

    def get(self, key) -> bytes:
        return self._call("get", (str(key),))

    def add(self, key, amount) -> int:
        return self._call("add", (str(key), int(amount)))

    def compare_set(self, key, expected_value, desired_value) -> bytes:
        return self._call("compare_set", (str(key), _bytes(expected_value), _bytes(desired_value)))

    def wait(self, keys, timeout: datetime.timedelta | None = None) -> None:
        self._call("wait", ([str(k) for k in keys],), timeout)

    def check(self, keys) -> bool:
        return self._call("check", ([str(k) for k in keys],))

    def delete_key(self, key) -> bool:
        return self._call("delete_key", (str(key),))

    def num_keys(self) -> int:
        return self._call("num_keys", ())

    def multi_get(self, keys) -> list:
        return self._call("multi_get", ([str(k) for k in keys],))

    def multi_set(self, keys, values) -> None:
        self._call("multi_set", ([str(k) for k in keys], [_bytes(v) for v in values]))

    def clone(self) -> ControllerStore:
        """Another handle on the same keys (torch clones stores for its own threads)."""
        return ControllerStore(self._link, self.generation, self.timeout)


def _bytes(value) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)
