"""The baseline of ``broadcast_1024``: the same fan-out through raw pyzmq, with
nothing of monarch_nb in it.

A ROUTER here sends one small HMAC-signed message per peer and collects one
signed reply from each; the peers are plain DEALERs, ``per_process`` of them in
each of a few processes (``python -m benchmarks.raw_fanout ADDR N KEY``), as
the simulated hosts hold our light ranks.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import struct
import subprocess
import sys
import time

import zmq


def _sign(key: bytes, payload: bytes) -> bytes:
    return hmac.new(key, payload, hashlib.sha256).digest()


class RawFanout:
    """``peers`` DEALERs in ``peers / per_process`` processes around one ROUTER."""

    def __init__(self, peers: int, per_process: int = 32):
        self.key = os.urandom(32)
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.SNDHWM, 0)
        self.router.setsockopt(zmq.RCVHWM, 0)
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        addr = f"tcp://127.0.0.1:{port}"
        self.procs = []
        left = peers
        while left > 0:
            n = min(per_process, left)
            left -= n
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "benchmarks.raw_fanout", addr, str(n), self.key.hex()],
                    env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
                )
            )
        self.peers: list[bytes] = []
        deadline = time.monotonic() + 120
        while len(self.peers) < peers:
            if not self.router.poll(1000) and time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.peers)} of {peers} raw peers joined")
            while self.router.poll(0):
                ident, _sig, _payload = self.router.recv_multipart()
                self.peers.append(ident)
        self.seq = 0

    def broadcast(self) -> None:
        """One signed message to every peer, one verified reply from each."""
        self.seq += 1
        body = pickle.dumps(("noop", self.seq))
        key, router = self.key, self.router
        for i, ident in enumerate(self.peers):
            payload = struct.pack("<QQ", i, self.seq) + body
            router.send_multipart([ident, _sign(key, payload), payload])
        for _ in self.peers:
            _ident, sig, payload = router.recv_multipart()
            if not hmac.compare_digest(sig, _sign(key, payload)):
                raise RuntimeError("a raw peer's reply does not verify")
            pickle.loads(payload)

    def close(self) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait(10)
        self.router.close(linger=0)
        self.ctx.term()

    def __enter__(self) -> RawFanout:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _peer(addr: str, n: int, key: bytes) -> None:
    """``n`` DEALERs: each answers every signed message with a signed reply."""
    ctx = zmq.Context(1)
    poller = zmq.Poller()
    socks = []
    for _ in range(n):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(addr)
        hello = b"hello"
        s.send_multipart([_sign(key, hello), hello])
        poller.register(s, zmq.POLLIN)
        socks.append(s)
    parent = os.getppid()
    while os.getppid() == parent:
        for s, _ in poller.poll(500):
            while s.poll(0):
                sig, payload = s.recv_multipart()
                if not hmac.compare_digest(sig, _sign(key, payload)):
                    continue
                pickle.loads(payload[16:])
                reply = pickle.dumps(("ok", struct.unpack("<QQ", payload[:16])))
                s.send_multipart([_sign(key, reply), reply])


if __name__ == "__main__":
    _peer(sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3]))
