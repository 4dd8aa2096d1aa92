"""Where a message for a rank leaves the controller's ROUTER.

A rank with a socket of its own gets its messages there, several in one
envelope. A rank served by a host agent that fans out (``hosts.py``) gets them
through its host's socket: one envelope per host and group of its ranks that
get the same messages, led by a ``HostCommand`` naming those ranks. Used by
whoever holds the IO loop's lease.
"""

from __future__ import annotations

from concurrent.futures import Future

from ..protocol.wire import send_frames


class Routes:
    """The routes of one mesh's ROUTER: ``identities`` (rank -> socket identity,
    filled by the worker set) and ``hosts`` (the identities that are host sockets)."""

    def __init__(self, router, identities: dict):
        self.router = router
        self.identities = identities
        self.hosts: set[bytes] = set()
        self.seal = lambda inner, count, identity: inner  # the envelope per destination
        self.encode_host_command = lambda targets, count: None  # -> its frames

    def send_now(self, identity: bytes, frames) -> None:
        """One encoded message to one socket, sealed."""
        send_frames(self.router, [identity, *self.seal(frames, 1, identity)])

    def flush(self, batches: dict) -> None:
        """Send ``batches`` (rank -> encoded messages) and clear it: one envelope per
        rank, or per host and group of its ranks that get the same messages."""
        router, seal, hosts = self.router, self.seal, self.hosts
        via: dict | None = None  # (host identity, message ids) -> (ranks, messages)
        for r, msgs in batches.items():
            ident = self.identities.get(r)
            if ident is None:
                continue
            if hosts and ident in hosts:  # once per host for the ranks that get the same
                if via is None:
                    via = {}
                key = (ident, *map(id, msgs))
                g = via.get(key)
                if g is None:
                    via[key] = ([r], msgs)
                else:
                    g[0].append(r)
                continue
            if len(msgs) == 1:
                send_frames(router, [ident, *seal(msgs[0], 1, ident)])
            else:
                inner = [f for frames in msgs for f in frames]
                send_frames(router, [ident, *seal(inner, len(msgs), ident)])
        if via:
            for key, (ranks, msgs) in via.items():
                self.to_host(key[0], ranks, msgs)
        batches.clear()

    def to_host(self, identity: bytes, ranks, msgs: list) -> None:
        """Buffer-less ``msgs`` for ``ranks`` of one host, in one envelope after their
        HostCommand."""
        inner = list(self.encode_host_command(tuple(ranks), len(msgs)))
        for frames in msgs:
            inner += frames
        send_frames(self.router, [identity, *self.seal(inner, len(msgs) + 1, identity)])

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
