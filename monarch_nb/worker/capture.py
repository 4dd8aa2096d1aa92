"""Routing of sys.stdout / sys.stderr: text written while a command runs goes to
that command's stream outbox, and so does text written by the threads and the
forked processes that command started (under its ident, so it lands under the
cell that ran it even after that cell ended); anything else to the process's
own stream."""

from __future__ import annotations

import io
import os
import threading

from .forked import ChildChannel

_current = threading.local()  # .outbox while a command runs on this thread
_ROUTE = "_monarch_route"  # attribute of a Thread started by user code: (outbox, ident)
_child: ChildChannel | None = None  # set in a process forked from the worker
_child_fd: int | None = None  # the worker's pipe for its children's output
_real_start = threading.Thread.start


def set_outbox(outbox) -> None:
    _current.outbox = outbox


CLEAR = "clear"  # the output "name" of a clear_output(): text "wait" or "now", in order


def mark_clear(wait: bool) -> None:
    """``clear_output(wait)`` in the running command: an event in its output, in
    order with its text, which the kernel turns into this rank's clear."""
    route = _route_here()
    if route is not None and _child is None:
        route[0].write(CLEAR, "wait" if wait else "now", route[1])


def _route_here() -> tuple | None:
    """(outbox, ident) of the command this thread runs or was started by."""
    outbox = getattr(_current, "outbox", None)
    if outbox is not None:
        return outbox, outbox.ident
    return getattr(threading.current_thread(), _ROUTE, None)


def _start(thread: threading.Thread) -> None:
    """Thread.start, remembering which command started the thread."""
    route = _route_here()
    if route is not None and route[1] is not None:
        setattr(thread, _ROUTE, route)
    _real_start(thread)


def _after_fork_in_child() -> None:
    global _child
    if _child_fd is None:
        return
    route = _route_here()
    if route is None:
        stream_id, ident = 0, None
    else:
        stream_id, ident = route[0].stream_id, route[1]
    _child = ChildChannel(_child_fd, stream_id, ident)


def install(child_fd: int) -> None:
    """Route user threads' and forked children's output (once per worker process)."""
    global _child_fd
    _child_fd = child_fd
    threading.Thread.start = _start
    os.register_at_fork(after_in_child=_after_fork_in_child)


class RoutedWriter(io.TextIOBase):
    """A text stream that forwards writes to the running command's outbox."""

    def __init__(self, name: str, fallback):
        self.name = name
        self._fallback = fallback

    def writable(self) -> bool:
        return True

    @property
    def encoding(self):
        return "utf-8"

    @property
    def errors(self):
        return "replace"

    def isatty(self) -> bool:
        return False

    def close(self) -> None:
        """Shared by every command of the worker: user code closing it closes nothing."""

    def fileno(self) -> int:
        return self._fallback.fileno()

    @property
    def buffer(self) -> _BytesWriter:
        """``sys.stdout.buffer``: bytes written here are decoded as UTF-8 (invalid
        bytes become U+FFFD) and routed like text."""
        return _BytesWriter(self)

    def write(self, s) -> int:
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        if not s.isascii():
            s = utf8_safe(s)
        if _child is not None:  # a forked child: never the parent's sockets or locks
            _child.write(self.name, s)
            return len(s)
        outbox = getattr(_current, "outbox", None)
        if outbox is not None:
            outbox.write(self.name, s)
            return len(s)
        route = getattr(threading.current_thread(), _ROUTE, None)
        if route is not None:
            route[0].write(self.name, s, route[1])
            return len(s)
        return self._fallback.write(s)

    def flush(self) -> None:
        if _child is not None:
            return  # a child's writes are unbuffered
        if getattr(_current, "outbox", None) is None:
            self._fallback.flush()


class NoInput(io.TextIOBase):
    """A worker's sys.stdin: there is nobody to type. Reading fails with a clear
    EOFError; closing it (``exit()`` does) closes nothing."""

    def readable(self) -> bool:
        return True

    def readline(self, size: int = -1) -> str:
        raise EOFError(
            "a worker has no stdin: input() cannot read there "
            "(send values with mesh.push(...), or pause with breakpoint())"
        )

    read = readline

    def close(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


class _BytesWriter(io.BufferedIOBase):
    def __init__(self, text: RoutedWriter):
        self._text = text

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        data = bytes(b)
        self._text.write(data.decode("utf-8", "replace"))
        return len(data)

    def flush(self) -> None:
        self._text.flush()


def utf8_safe(s: str) -> str:
    """``s`` unless it holds lone surrogates (from bytes decoded with surrogateescape,
    say), which no UTF-8 consumer takes: those become U+FFFD."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
