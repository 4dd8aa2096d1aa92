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

    def fileno(self) -> int:
        return self._fallback.fileno()

    def write(self, s) -> int:
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        outbox = getattr(_current, "outbox", None)
        if outbox is None:
            return self._fallback.write(s)
        outbox.write(self.name, s)
        return len(s)

    def flush(self) -> None:
        outbox = getattr(_current, "outbox", None)
        if outbox is None:
            self._fallback.flush()
