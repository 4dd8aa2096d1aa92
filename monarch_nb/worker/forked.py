"""Output of processes forked by user code (DataLoader workers, multiprocessing).

A forked child inherits the worker's ZeroMQ sockets and the locks of its output
machinery in whatever state another thread left them: it must touch neither.
So at fork the child's ``sys.stdout`` / ``sys.stderr`` switch to a pipe the
worker made at start-up: each write goes out at once as frames of at most
PIPE_BUF bytes (a pipe writes those atomically, so children never interleave
inside a frame and need no lock). A reader thread in the worker turns the
frames back into text and hands it to the outbox of the stream whose command
forked, under that command's ident: the output lands under the cell that
started the child, tagged with the worker's rank.
"""

from __future__ import annotations

import codecs
import logging
import os
import select
import struct
import threading
import time

logger = logging.getLogger("monarch_nb.worker")

_HEADER = struct.Struct("<iqiB")  # pid, ident (-1: none), stream id, name (0 stdout, 1 stderr)
FRAME = getattr(select, "PIPE_BUF", 4096)  # written atomically by the kernel
_PAYLOAD = FRAME - _HEADER.size - 2  # 2: the payload length
_NAMES = ("stdout", "stderr")


class ChildChannel:
    """The writing end, used only inside a forked child."""

    def __init__(self, fd: int, stream_id: int, ident: int | None):
        self.fd = fd
        self.stream_id = stream_id
        self.ident = -1 if ident is None else ident
        self.pid = os.getpid()

    def write(self, name: str, text: str) -> None:
        data = text.encode("utf-8", "replace")
        head = _HEADER.pack(self.pid, self.ident, self.stream_id, _NAMES.index(name))
        for i in range(0, len(data), _PAYLOAD):
            chunk = data[i : i + _PAYLOAD]
            frame = head + struct.pack("<H", len(chunk)) + chunk
            try:
                os.write(self.fd, frame)
            except OSError:  # the worker is gone: nobody to tell
                return


class ChildOutputReader:
    """The worker's end: a daemon thread routing children's frames to outboxes.

    Text is passed on by whole lines per child (a line still being written goes
    after PARTIAL_AGE), so two DataLoader workers printing at once never mix
    inside a line."""

    PARTIAL_AGE = 0.05

    def __init__(self, fd: int, route):
        self.fd = fd
        self._route = route  # (stream id, ident or None, name, text) -> None
        self._decoders: dict = {}
        self._partial: dict = {}  # (pid, name) -> [since, stream id, ident, text]
        self.thread = threading.Thread(target=self._run, name="monarch-child-output", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        buf = b""
        while True:
            try:
                wait = self.PARTIAL_AGE if self._partial else None  # idle: no wake-ups
                ready, _, _ = select.select([self.fd], [], [], wait)
                data = os.read(self.fd, 1 << 16) if ready else None
            except InterruptedError:
                continue
            except OSError:
                return
            if data == b"":
                return
            if data:
                buf += data
                buf = self._frames(buf)
            self._flush_stale()

    def _flush_stale(self) -> None:
        if not self._partial:
            return
        now = time.monotonic()
        for key, (since, stream_id, ident, text) in list(self._partial.items()):
            if now - since >= self.PARTIAL_AGE:
                del self._partial[key]
                self._send(stream_id, ident, key[1], text)

    def _send(self, stream_id: int, ident, name: int, text: str) -> None:
        try:
            self._route(stream_id, ident, _NAMES[name], text)
        except Exception:
            logger.exception("routing a forked child's output failed")

    def _take(self, pid: int, stream_id: int, ident, name: int, text: str) -> None:
        """Pass on the whole lines of this child's text; keep the rest a moment."""
        key = (pid, name)
        part = self._partial.pop(key, None)
        if part is not None:
            text = part[3] + text
        cut = text.rfind("\n") + 1
        if cut:
            self._send(stream_id, ident, name, text[:cut])
            text = text[cut:]
        if text:
            since = part[0] if part is not None and not cut else time.monotonic()
            self._partial[key] = [since, stream_id, ident, text]

    def _frames(self, buf: bytes) -> bytes:
        at, n = 0, len(buf)
        head = _HEADER.size + 2
        while n - at >= head:
            pid, ident, stream_id, name = _HEADER.unpack_from(buf, at)
            (size,) = struct.unpack_from("<H", buf, at + _HEADER.size)
            if n - at < head + size:
                break
            payload = buf[at + head : at + head + size]
            at += head + size
            key = (pid, name)
            dec = self._decoders.get(key)
            if dec is None:
                if len(self._decoders) > 1024:  # children come and go: forget old ones
                    self._decoders.clear()
                dec = self._decoders[key] = codecs.getincrementaldecoder("utf-8")("replace")
            text = dec.decode(payload)
            if text:
                self._take(pid, stream_id, None if ident < 0 else ident, name, text)
        return buf[at:]
