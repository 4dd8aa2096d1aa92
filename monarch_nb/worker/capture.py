"""Routing of sys.stdout / sys.stderr: text written while a command runs goes to
that command's stream outbox; anything else to the process's own stream."""

from __future__ import annotations

import io
import threading

_current = threading.local()  # .outbox while a command runs on this thread


def set_outbox(outbox) -> None:
    _current.outbox = outbox


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
        outbox = getattr(_current, "outbox", None)
        if outbox is None:
            return self._fallback.write(s)
        outbox.write(self.name, s)
        return len(s)

    def flush(self) -> None:
        outbox = getattr(_current, "outbox", None)
        if outbox is None:
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
