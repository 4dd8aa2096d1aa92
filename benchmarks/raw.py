"""Raw pyzmq baselines: what the same traffic costs with nothing but pyzmq and pickle.

``RawPeer`` binds a ROUTER socket in this process (like the controller) and
starts a child process with one DEALER socket (like a worker) over TCP on
127.0.0.1, the transport ``local_mesh`` uses. The child imports only the
standard library and pyzmq (``python -c``, not multiprocessing, so that it
never imports torch or monarch_nb), and it always exits: on a ``stop``
message, when its parent dies (it polls ``getppid``), or when ``close`` gives
up waiting and kills it.

Messages to the peer are single pickled tuples:

* ``("ping", i, ...)``   -> the peer unpickles it and replies ``("pong", i)`` pickled
* ``("call", ..., last)`` -> unpickled; only a message with ``last`` true is acknowledged
* ``("blob", nbytes)``   -> the peer sends a header frame and ``nbytes`` of data with
  ``copy=False`` (one buffer made once, like a tensor that lives on a worker)
* ``("stop",)``          -> the peer exits
"""

from __future__ import annotations

import atexit
import os
import pickle
import subprocess
import sys
import time
import weakref

import zmq

PEER_IDENTITY = b"raw-peer"
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_live: weakref.WeakSet = weakref.WeakSet()

# about the size of a pickled CallFunction's function reference
_FN_PAYLOAD = pickle.dumps(("benchmarks.core", "noop"), protocol=5) * 2


def peer_main(argv: list[str] | None = None) -> None:
    """The child: ``python -c '...peer_main()' ADDRESS PARENT_PID``."""
    argv = sys.argv[1:] if argv is None else argv
    address, parent = argv[0], int(argv[1])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, PEER_IDENTITY)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    sock.send(pickle.dumps(("ready", os.getpid()), protocol=5))
    blobs: dict[int, bytes] = {}
    try:
        while True:
            if not sock.poll(500):
                if os.getppid() != parent:
                    return  # the benchmark process died: do not outlive it
                continue
            msg = pickle.loads(sock.recv(copy=False).buffer)
            kind = msg[0]
            if kind == "ping":
                sock.send(pickle.dumps(("pong", msg[1]), protocol=5))
            elif kind == "call":
                if msg[-1]:
                    sock.send(pickle.dumps(("ack", msg[1]), protocol=5))
            elif kind == "blob":
                n = msg[1]
                data = blobs.get(n)
                if data is None:
                    blobs.clear()
                    data = blobs[n] = b"\x01" * n  # touched memory, like a filled tensor
                header = pickle.dumps(("blob", n), protocol=5)
                tracker = sock.send_multipart([header, data], copy=False, track=True)
                tracker.wait()
            elif kind == "stop":
                return
    finally:
        sock.close(linger=0)
        ctx.term()


class RawPeer:
    """A ROUTER here and a DEALER peer in a child process. Use as a context manager."""

    def __init__(self, timeout: float = 60.0):
        self._ctx = zmq.Context()
        self._sock = s = self._ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))  # never hang on a dead peer
        port = s.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
        code = "from benchmarks.raw import peer_main; peer_main()"
        self._proc = subprocess.Popen(
            [sys.executable, "-c", code, self.address, str(os.getpid())],
            env=env,
            stdin=subprocess.DEVNULL,
        )
        self._closed = False
        _live.add(self)
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._sock.poll(100):
                ident, payload = self._sock.recv_multipart()
                if ident == PEER_IDENTITY and pickle.loads(payload)[0] == "ready":
                    return
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"raw peer exited with code {self._proc.returncode} before ready"
                )
        raise TimeoutError(f"raw peer not ready after {timeout:.0f} s")

    def _send(self, obj) -> None:
        self._sock.send_multipart([PEER_IDENTITY, pickle.dumps(obj, protocol=5)])

    def _recv(self):
        _, payload = self._sock.recv_multipart(copy=False)
        return pickle.loads(payload.buffer)

    # ------------------------------------------------------------ measurements

    def rtt(self, n: int) -> float:
        """Seconds per round trip, mean over ``n`` ping-pongs of a small pickled tuple."""
        t0 = time.perf_counter()
        for i in range(n):
            self._send(("ping", i, 0.0, "noop"))
            reply = self._recv()
            assert reply[1] == i
        return (time.perf_counter() - t0) / n

    def pipelined(self, n: int) -> float:
        """Seconds for ``n`` pickled messages sent back to back, acknowledged once at the end."""
        sock, ident = self._sock, PEER_IDENTITY
        t0 = time.perf_counter()
        for i in range(n):
            payload = pickle.dumps(
                ("call", i, i + 1, _FN_PAYLOAD, None, 0, 0, "noop", i == n - 1), protocol=5
            )
            sock.send_multipart([ident, payload])
        reply = self._recv()
        elapsed = time.perf_counter() - t0
        assert reply == ("ack", n - 1)
        return elapsed

    def fetch(self, nbytes: int) -> float:
        """Seconds to request and receive ``nbytes`` sent zero-copy (``copy=False`` both ends)."""
        t0 = time.perf_counter()
        self._send(("blob", nbytes))
        frames = self._sock.recv_multipart(copy=False)
        data = memoryview(frames[2].buffer)
        elapsed = time.perf_counter() - t0
        assert pickle.loads(frames[1].buffer) == ("blob", nbytes) and data.nbytes == nbytes
        return elapsed

    # ------------------------------------------------------------ life cycle

    def close(self) -> None:
        """Stop the peer (stop message, then SIGTERM, then SIGKILL) and close the socket."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._proc.poll() is None:
                try:
                    self._sock.send_multipart([PEER_IDENTITY, pickle.dumps(("stop",))], zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
                for stop in (None, self._proc.terminate, self._proc.kill):
                    if stop is not None:
                        stop()
                    try:
                        self._proc.wait(3.0)
                        break
                    except subprocess.TimeoutExpired:
                        continue
        finally:
            self._sock.close(linger=0)
            self._ctx.term()
            _live.discard(self)

    def __enter__(self) -> RawPeer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@atexit.register
def _close_all() -> None:
    for peer in list(_live):
        try:
            peer.close()
        except Exception:
            pass
