"""Pipes: a side process per rank that runs ``fn(pipe, *args)`` and sends values
(a data loader). The worker receives them on a stream, one per ``recv``.

The two ends talk over a ZeroMQ PAIR socket on an ipc path in a private (0700)
directory. Back-pressure is by credit: the side process starts with
``max_messages`` credits, spends one per value and gets one back per value
received, so at most ``max_messages`` values wait (socket buffers alone would
let hundreds of small ones through). The side process dies with its worker
(parent-death signal plus a parent check).

Run as ``python -m monarch_nb.worker.pipe ADDRESS MAX_MESSAGES PARENT_PID``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

import zmq

from ..protocol.wire import dumps, loads, resolve_function, unpack_args

_POLL_MS = 50


class PipeEnded(EOFError):
    """The pipe's function returned: there is nothing more to receive."""


class PipeFailed(RuntimeError):
    """The pipe's function raised; its traceback is the message."""


class WorkerPipe:
    """The worker's end of one pipe."""

    def __init__(
        self, ctx: zmq.Context, function, args, max_messages: int, coords: dict, sizes: dict
    ):
        self._dir = tempfile.mkdtemp(prefix="mnb-pipe-")
        os.chmod(self._dir, 0o700)
        address = f"ipc://{self._dir}/pipe"
        self._lock = threading.Lock()
        self._sock = ctx.socket(zmq.PAIR)
        self._sock.setsockopt(zmq.RCVHWM, max_messages)
        self._sock.setsockopt(zmq.SNDHWM, max_messages)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "monarch_nb.worker.pipe",
                address,
                str(max_messages),
                str(os.getpid()),
            ],
            env=env,
            stdin=subprocess.DEVNULL,
        )
        payload, buffers = dumps((function, args, coords, sizes))
        self._sock.send_multipart([payload, *(b.raw() for b in buffers)])
        self._ended = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def recv(self):
        """The next value; waits (interruptibly) while the side process works."""
        with self._lock:
            if self._ended:
                raise PipeEnded("the pipe's function has returned: no more values")
            while not self._sock.poll(_POLL_MS):
                code = self.process.poll()
                if code is not None and not self._sock.poll(0):
                    self._ended = True
                    raise PipeFailed(
                        f"the pipe process exited ({_describe_exit(code)}) before sending a value"
                    )
            frames = self._sock.recv_multipart(copy=False)
            kind, value = loads(frames[0].buffer, [f.buffer for f in frames[1:]])
            if kind == "value":
                try:
                    self._sock.send(b"", zmq.NOBLOCK)  # one credit back
                except zmq.Again:
                    pass  # the side process has finished: it needs no credit
                return value
            self._ended = True
            try:
                self._sock.send(b"bye", zmq.NOBLOCK)  # the side process may exit now
            except zmq.Again:
                pass
            if kind == "error":
                raise PipeFailed(value)
            raise PipeEnded("the pipe's function has returned: no more values")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(2)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(2)
        with self._lock:
            self._sock.close(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class Pipe:
    """What the pipe's function gets: ``send(value)``; ``ranks`` (this rank's
    coordinates) and ``sizes`` (the mesh's dims)."""

    def __init__(self, sock: zmq.Socket, ranks: dict, sizes: dict, credits: int):
        self._sock = sock
        self._credits = credits
        self.ranks = ranks
        self.sizes = sizes

    def send(self, value) -> None:
        """Send a value; blocks while ``max_messages`` values wait unreceived."""
        while self._sock.poll(0):
            self._sock.recv()
            self._credits += 1
        if self._credits == 0:
            self._sock.recv()
            self._credits += 1
        self._credits -= 1
        payload, buffers = dumps(("value", value))
        self._sock.send_multipart([payload, *(b.raw() for b in buffers)], copy=False)


def _main(argv: list[str]) -> None:
    address, max_messages, parent = argv[0], int(argv[1]), int(argv[2])
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the worker
    except Exception:
        pass
    if os.getppid() != parent:
        os._exit(1)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.SNDHWM, max_messages)
    sock.setsockopt(zmq.RCVHWM, max_messages)
    sock.connect(address)
    frames = sock.recv_multipart(copy=False)
    function, args, ranks, sizes = loads(frames[0].buffer, [f.buffer for f in frames[1:]])
    pipe = Pipe(sock, ranks, sizes, max_messages)
    try:
        fn = resolve_function(function)
        a, kw = unpack_args(args, lambda rid: None)
        fn(pipe, *a, **kw)
        sock.send_multipart([dumps(("end", None))[0]])
    except BaseException as e:  # noqa: B036 - the worker reports it at the next recv
        from .failure import format_user_traceback

        sock.send_multipart([dumps(("error", format_user_traceback(e)))[0]])
    # ZeroMQ drops what a peer has not read when the connection ends: stay until
    # the worker has received everything (it says "bye"); close() or the worker's
    # death end this process otherwise
    while sock.recv() != b"bye":
        pass
    sock.close(linger=0)
    ctx.term()


if __name__ == "__main__":
    _main(sys.argv[1:])
