"""Publishing to the notebook under a chosen cell, from any thread.

In an ipykernel the messages go straight to the kernel's IOPub socket with the
parent header of the cell they belong to (``kernel.session.send`` on the
IOPub socket is thread-safe: the socket is a wrapper that hands frames to the
kernel's IOPub thread). That is how output of a ``--noblock`` cell, published
by a background thread, still lands under its own cell. Outside a kernel
(terminal IPython, plain Python) text goes to the process's stdout/stderr.

One background thread (``Ticker``) calls the registered flushers every TICK
seconds: it is the only place where live output leaves for the notebook, which
bounds the message rate whatever the workers print.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable

logger = logging.getLogger("monarch_nb.notebook")

TICK = 0.1  # seconds between publications of live output (so <= 10 per cell and stream name)


class Publisher:
    """Sends stream/display/error messages under a parent header (or the current cell's)."""

    def __init__(self, shell=None):
        self.shell = shell
        self.kernel = getattr(shell, "kernel", None)
        if self.kernel is not None and getattr(self.kernel, "iopub_socket", None) is None:
            self.kernel = None

    @property
    def in_kernel(self) -> bool:
        return self.kernel is not None

    def current_parent(self):
        """The request of the cell that runs now (or ran last)."""
        if self.kernel is None:
            return None
        try:
            return self.kernel.get_parent("shell")
        except Exception:
            return None

    def _send(self, msg_type: str, content: dict, parent, topic: bytes) -> None:
        k = self.kernel
        if parent is None:
            parent = self.current_parent()
        try:
            k.session.send(k.iopub_socket, msg_type, content, parent=parent, ident=topic)
        except Exception:  # the kernel is shutting down
            logger.debug("publishing %s failed", msg_type, exc_info=True)

    def stream(self, parent, name: str, text: str) -> None:
        if not text:
            return
        if self.kernel is None:
            out = sys.__stdout__ if name == "stdout" else sys.__stderr__
            out.write(text)
            out.flush()
            return
        self._send("stream", {"name": name, "text": text}, parent, b"stream." + name.encode())

    def display(
        self, parent, data: dict, metadata: dict | None = None, display_id: str | None = None
    ) -> None:
        """``display_data``; with ``display_id``, one that ``update_display`` redraws."""
        if self.kernel is None:
            sys.__stdout__.write(str(data.get("text/plain", "")) + "\n")
            sys.__stdout__.flush()
            return
        transient = {"display_id": display_id} if display_id else {}
        content = {"data": data, "metadata": metadata or {}, "transient": transient}
        self._send("display_data", content, parent, b"display_data")

    def update_display(self, parent, data: dict, display_id: str) -> None:
        """Redraw the display shown with ``display_id`` (in a kernel; else nothing)."""
        if self.kernel is None:
            return
        content = {"data": data, "metadata": {}, "transient": {"display_id": display_id}}
        self._send("update_display_data", content, parent, b"update_display_data")

    def clear_output(self, parent, wait: bool = True) -> None:
        """``clear_output`` of the cell under ``parent`` (in a kernel; else nothing)."""
        if self.kernel is not None:
            self._send("clear_output", {"wait": wait}, parent, b"clear_output")

    def comm(
        self, parent, msg_type: str, content: dict, metadata: dict, buffers: list
    ) -> None:
        """A ``comm_open`` / ``comm_msg`` / ``comm_close`` (in a kernel; else nothing)."""
        k = self.kernel
        if k is None:
            return
        if parent is None:
            parent = self.current_parent()
        topic = f"comm-{content['comm_id']}".encode()
        try:
            k.session.send(
                k.iopub_socket, msg_type, content, parent=parent, ident=topic,
                metadata=metadata, buffers=buffers,
            )
        except Exception:  # the kernel is shutting down
            logger.debug("publishing %s failed", msg_type, exc_info=True)

    def error(self, parent, ename: str, evalue: str, traceback: list[str]) -> None:
        if self.kernel is None:
            sys.__stderr__.write("\n".join(traceback) + "\n")
            sys.__stderr__.flush()
            return
        content = {"ename": ename, "evalue": evalue, "traceback": traceback}
        self._send("error", content, parent, b"error")


class Ticker:
    """A daemon thread calling every registered ``fn(now)`` each TICK seconds."""

    def __init__(self, period: float = TICK):
        self.period = period
        self._fns: dict[int, Callable[[float], None]] = {}
        self._lock = threading.RLock()  # a finalizer on a thread inside it may remove()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._next = 0

    def add(self, fn: Callable[[float], None]) -> int:
        start = None
        with self._lock:
            self._next += 1
            token = self._next
            self._fns[token] = fn
            t = self._thread  # (one made but not yet started has no ident: it will run)
            if t is None or (t.ident is not None and not t.is_alive()):
                self._thread = start = threading.Thread(
                    target=self._run, name="monarch-nb-out", daemon=True
                )
        if start is not None:  # outside the lock: a finalizer on the new thread may remove()
            start.start()
        return token

    def remove(self, token: int) -> None:
        with self._lock:
            self._fns.pop(token, None)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once on the ticker thread, at its next tick."""
        holder: list = []

        def once(now: float) -> None:
            self.remove(holder[0])
            fn()

        holder.append(self.add(once))
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait(self.period)
            self._wake.clear()
            with self._lock:
                fns = list(self._fns.values())
            now = time.monotonic()
            for fn in fns:
                try:
                    fn(now)
                except Exception:
                    logger.exception("monarch_nb output publisher failed (continuing)")
