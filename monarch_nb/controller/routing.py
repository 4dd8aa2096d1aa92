"""Where a message for a rank leaves the controller's ROUTER.

A rank with a socket of its own gets its messages there, several in one
envelope. A rank served by a host agent that fans out (``hosts.py``) gets them
through its host's socket: one envelope per host and group of its ranks that
get the same messages, led by a ``HostCommand`` naming those ranks. Tensor ops
handed over for the same ranks one after another become one ``RunOps``. Used
by whoever holds the IO loop's lease.
"""

from __future__ import annotations

from concurrent.futures import Future

import zmq

from ..protocol.constants import RECV_HWM
from ..protocol.wire import send_frames

MAX_OPS = 1024  # tensor ops in one RunOps at most


def bind_router(ctx, name: str, interface: str, port: int = 0) -> tuple:
    """``(socket, port)``: mesh ``name``'s ROUTER, bound on ``interface`` at ``port``
    (0: any free one); OSError naming the address when it cannot be had."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.SNDHWM, 0)
    # per worker socket: a flood (a 1 GB print) waits in the worker, not here
    router.setsockopt(zmq.RCVHWM, RECV_HWM)
    router.setsockopt(zmq.LINGER, 0)
    # hundreds of ranks joining at once: ZeroMQ's 100 drops SYNs (resent after 1 s)
    router.setsockopt(zmq.BACKLOG, 1024)
    if not port:
        return router, router.bind_to_random_port(f"tcp://{interface}")
    try:
        router.bind(f"tcp://{interface}:{port}")
    except zmq.ZMQError as e:
        router.close()
        raise OSError(f"mesh {name!r}: cannot listen on {interface}:{port}: {e}") from None
    return router, port


class Routes:
    """The routes of one mesh's ROUTER: ``identities`` (rank -> socket identity,
    filled by the worker set) and ``hosts`` (the identities that are host sockets)."""

    def __init__(self, router, identities: dict, seal, encode_host_command, encode_ops):
        self.router = router
        self.identities = identities
        self.hosts: set[bytes] = set()
        self.seal = seal  # (frames, count, identity) -> the envelope per destination
        self.encode_host_command = encode_host_command  # (targets, count) -> its frames
        self.encode_ops = encode_ops  # ops -> the frames of one RunOps of ``ops``
        self._ops: list = []  # tensor ops handed over, not encoded yet ...
        self._ops_ranks = None  # ... and their ranks
        self._runs: dict = {}  # host identity -> [targets, [messages], targets, ...]
        self._splits: dict = {}  # ranks -> (validity, split)
        self._epoch = 0

    def send_now(self, identity: bytes, frames) -> None:
        """One encoded message to one socket, sealed."""
        send_frames(self.router, [identity, *self.seal(frames, 1, identity)])

    def changed(self) -> None:
        """Who is behind which socket may have changed (a rank joined): split afresh."""
        self._epoch += 1

    def add_host(self, identity: bytes) -> None:
        self.hosts.add(identity)
        self._epoch += 1

    def drop_host(self, identity: bytes) -> None:
        self.hosts.discard(identity)
        self._epoch += 1

    def add_op(self, batches: dict, ranks, fields: tuple) -> None:
        """Queue one tensor op (a RunOps entry) for ``ranks``: it joins the ops queued
        just before it for the same ranks, in one RunOps."""
        ops = self._ops
        if ops and ranks is not self._ops_ranks and ranks != self._ops_ranks:
            self._end_ops(batches)
            ops = self._ops
        ops.append(fields)
        self._ops_ranks = ranks
        if len(ops) >= MAX_OPS:
            self._end_ops(batches)

    def _end_ops(self, batches: dict) -> None:
        ops, self._ops = self._ops, []
        self.add(batches, self._ops_ranks, self.encode_ops(tuple(ops)))

    def add(self, batches: dict, ranks, frames) -> None:
        """Queue buffer-less ``frames`` for ``ranks`` until ``flush``: in ``batches``
        (rank -> messages) for ranks with sockets of their own, per host otherwise."""
        if self._ops:  # the ops handed over before these frames go first
            self._end_ops(batches)
        if not self.hosts:
            _batch(batches, ranks, frames)
            return
        direct, hosted = self._split(ranks)
        _batch(batches, direct, frames)
        runs = self._runs
        for ident, targets in hosted:
            q = runs.get(ident)
            if q is None:
                runs[ident] = [targets, [frames]]
            elif q[-2] is targets:
                q[-1].append(frames)  # the same ranks as the message before: one command
            else:
                q += (targets, [frames])

    def _split(self, ranks) -> tuple:
        """``ranks`` as (ranks with sockets of their own, [(host identity, its ranks)]),
        kept while no host joins or leaves and nobody joins (a mesh's broadcasts use
        the same rank tuple: one hash instead of a lookup per rank)."""
        key = ranks if type(ranks) is tuple else tuple(ranks)
        identities = self.identities
        valid = (self._epoch, len(identities))
        hit = self._splits.get(key)
        if hit is not None and hit[0] == valid:
            return hit[1]
        direct, by_host = [], {}
        hosts, complete = self.hosts, True
        for r in key:
            ident = identities.get(r)
            if ident is None:
                complete = False
            elif ident in hosts:
                g = by_host.get(ident)
                if g is None:
                    by_host[ident] = [r]
                else:
                    g.append(r)
            else:
                direct.append(r)
        split = (direct, [(i, tuple(rs)) for i, rs in by_host.items()])
        if complete:
            if len(self._splits) > 64:
                self._splits.clear()
            self._splits[key] = (valid, split)
        return split

    def flush(self, batches: dict) -> None:
        """Send what was queued and clear it: one envelope per rank with messages, one
        per host (a HostCommand before each run of messages for the same ranks)."""
        if self._ops:
            self._end_ops(batches)
        router, seal, identities = self.router, self.seal, self.identities
        for r, msgs in batches.items():
            ident = identities.get(r)
            if ident is None:
                continue
            if len(msgs) == 1:
                send_frames(router, [ident, *seal(msgs[0], 1, ident)])
            else:
                inner = [f for frames in msgs for f in frames]
                send_frames(router, [ident, *seal(inner, len(msgs), ident)])
        batches.clear()
        if self._runs:
            for ident, q in self._runs.items():
                self._send_runs(ident, q)
            self._runs.clear()

    def to_host(self, identity: bytes, ranks, msgs: list) -> None:
        """Buffer-less ``msgs`` for ``ranks`` of one host, in one envelope."""
        self._send_runs(identity, [tuple(ranks), msgs])

    def _send_runs(self, identity: bytes, q: list) -> None:
        inner: list = []
        count = 0
        for i in range(0, len(q), 2):
            targets, msgs = q[i], q[i + 1]
            inner += self.encode_host_command(targets, len(msgs))
            for frames in msgs:
                inner += frames
            count += len(msgs) + 1
        send_frames(self.router, [identity, *self.seal(inner, count, identity)])

    def route(self, ranks, frames, done: Future | None) -> None:
        """Send one message (any shape) to ``ranks``; ``done`` gets the ZeroMQ tracker
        of a zero-copy send."""
        router, hosts = self.router, self.hosts
        tracker = None
        hosted: dict | None = None  # host identity -> its ranks among ``ranks``
        try:
            for r in ranks:
                ident = self.identities.get(r)
                if ident is None:
                    continue
                if hosts and ident in hosts:
                    if hosted is None:
                        hosted = {}
                    hosted.setdefault(ident, []).append(r)
                    continue
                sealed = self.seal(frames, 1, ident)
                if done is None:
                    send_frames(router, [ident, *sealed])
                else:
                    tracker = router.send_multipart([ident, *sealed], copy=False, track=True)
            for ident, rs in (hosted or {}).items():  # the command alone, then the message
                head = self.encode_host_command(tuple(rs), 1)
                send_frames(router, [ident, *self.seal(head, 1, ident)])
                sealed = self.seal(frames, 1, ident)
                if done is None:
                    send_frames(router, [ident, *sealed])
                else:
                    tracker = router.send_multipart([ident, *sealed], copy=False, track=True)
        finally:
            if done is not None:
                done.set_result(tracker)


def _batch(batches: dict, ranks, frames) -> None:
    """``frames`` after what each of ``ranks`` has in ``batches`` already."""
    for r in ranks:
        b = batches.get(r)
        if b is None:
            batches[r] = [frames]
        else:
            b.append(frames)
