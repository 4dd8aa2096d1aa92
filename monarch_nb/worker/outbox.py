"""A stream's own socket to the controller (``Outbox``): its output, buffered and
flushed in chunks, and what it sends (results, failures), in order."""

from __future__ import annotations

import threading
import time

import zmq

from ..protocol import encode
from ..protocol.constants import BIG_SEND, PROGRESS_BYTES
from ..protocol.envelope import Sealer
from ..protocol.messages import FetchResult, Output, TransferBegin
from ..protocol.wire import send_frames

OUTPUT_CHUNK = 64 << 10  # flush buffered output at this size
# messages a stream may have on their way before its sends block: with the
# controller's receive limit, a flood of output (a 1 GB print) waits for the
# controller instead of piling up in either process's memory (while no controller
# listens at all, what does not fit is dropped instead: Outbox._flush_locked)
SEND_HWM = 256

_RUNNING = object()  # Outbox.write's default ident: the running command's


class Outbox:
    """A stream's own socket to the controller and its buffered output.

    Everything a stream sends (output, results, failures) leaves through this one
    socket, sealed with the socket's own sequence numbers, so the controller
    sees it in order (and would notice a gap). The receiver thread may flush
    stale output while a long command runs: the lock serialises use of the
    socket (ZeroMQ sockets may move between threads across a memory barrier).
    """

    def __init__(self, worker, stream_id: int):
        self._worker = worker
        self.stream_id = stream_id
        self.lock = threading.Lock()
        self._sock: zmq.Socket | None = None
        self._sealer: Sealer | None = None
        self._pending: list = []  # [name, ident, text]
        self._pending_bytes = 0
        self._pending_since = 0.0
        self.ident: int | None = None  # command whose output is being written
        self.dropped = 0  # bytes of output dropped while no controller listened

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            self._sock = self._worker.connect_socket(SEND_HWM)
            self._sealer = Sealer(self._worker.signer, self._worker.rank)
        return self._sock

    def write(self, name: str, text: str, ident=_RUNNING) -> None:
        """Buffer ``text`` as output of command ``ident`` (default: the one running)."""
        with self.lock:
            if ident is _RUNNING:
                ident = self.ident
            p = self._pending
            if p and p[-1][0] == name and p[-1][1] == ident and len(text) < OUTPUT_CHUNK:
                p[-1][2] += text  # coalesce small writes (a large text is not copied)
            else:
                if not p:
                    self._pending_since = time.monotonic()
                    if self._worker.quiet:  # the idle holder's poll is long: end it
                        self._worker.wake_holder()
                p.append([name, ident, text])
            self._pending_bytes += len(text)
            if self._pending_bytes >= OUTPUT_CHUNK:
                self._flush_locked()

    def _flush_locked(self, block: bool = True) -> None:
        """Send the buffered output. Not blocking (the receiver thread, which must
        keep answering): stop where the socket is full and keep the rest. While no
        controller listens (a kept-alive mesh's), what does not fit in the socket's
        queue is dropped and counted: the stream goes on, its memory bounded."""
        rank = self._worker.rank
        pending = self._pending
        gone = self._worker.controller_gone
        if self.dropped and not gone:
            note = f"[... {self.dropped} bytes of output dropped: no controller listened ...]\n"
            if not self._send_locked(Output(rank, self.stream_id, None, "stderr", note), block):
                return
            self.dropped = 0
        while pending:
            entry = pending[0]
            name, ident, text = entry
            for i in range(0, len(text), OUTPUT_CHUNK):
                msg = Output(rank, self.stream_id, ident, name, text[i : i + OUTPUT_CHUNK])
                if not self._send_locked(msg, block):
                    if gone:  # the queue is full and nobody reads it
                        self.dropped += len(text) - i + sum(len(e[2]) for e in pending[1:])
                        pending.clear()
                        self._pending_bytes = 0
                        return
                    entry[2] = text[i:]
                    self._pending_bytes = sum(len(e[2]) for e in pending)
                    return
            pending.pop(0)
        self._pending_bytes = 0

    def _send_locked(self, msg, block: bool = True, frames=None) -> bool:
        if frames is None:
            frames = encode(msg, self._worker.signer)
        sock = self._socket()
        sealer = self._sealer
        nbytes = sum(memoryview(f).nbytes for f in frames[2:]) if len(frames) > 2 else 0
        if nbytes > PROGRESS_BYTES and type(msg) is FetchResult:
            # the controller shows a progress bar for this transfer
            begin = TransferBegin(self._worker.rank, msg.ident, nbytes)
            sock.send_multipart(sealer.seal(encode(begin, self._worker.signer)))
        sealed = sealer.seal(frames)
        if block and self._worker.controller_gone:
            block = False  # nobody reads: a full queue must not stop the stream
        if nbytes > BIG_SEND and block:
            # zero-copy: wait until ZeroMQ no longer reads the value's memory
            tracker = sock.send_multipart(sealed, copy=False, track=True)
            tracker.wait()
        elif block:
            send_frames(sock, sealed)
        else:
            try:
                send_frames(sock, sealed, nowait=True)
            except zmq.Again:
                sealer.retract()  # not sent: the next message takes its number
                return False
        return True

    def send(self, msg, frames=None) -> None:
        """Send ``msg`` (``frames``: as ``encode`` made it already) after any output
        written before it."""
        with self.lock:
            if self._pending:
                self._flush_locked()
            self._send_locked(msg, frames=frames)

    def flush(self) -> None:
        if self._pending:
            with self.lock:
                if self._pending:
                    self._flush_locked()

    @property
    def pending(self) -> bool:
        """Output is buffered, not yet sent."""
        return bool(self._pending)

    def flush_if_stale(self, now: float, age: float) -> None:
        """Called by the receiver thread: never waits for the stream (which may be
        sending) nor for a full socket."""
        if self._pending and now - self._pending_since >= age and self.lock.acquire(False):
            try:
                if self._pending:
                    self._flush_locked(block=False)
            finally:
                self.lock.release()

    def close(self) -> None:
        with self.lock:
            if self._sock is not None:
                self._sock.close(linger=2000)
                self._sock = None
                self._sealer = None
