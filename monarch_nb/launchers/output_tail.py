"""The last lines a worker wrote (a crash names the rank with them)."""

from __future__ import annotations

from collections import deque


class OutputTail:
    """The last lines a worker wrote to its stdout/stderr (the crash message shows them)."""

    TAIL_LINES = 60

    def __init__(self):
        self.lines: deque[str] = deque(maxlen=self.TAIL_LINES)
        self._partial = b""

    def feed(self, data: bytes) -> None:
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            self.lines.append(line.decode("utf-8", "replace"))
        if len(self._partial) > 8192:
            self.end()

    def end(self) -> None:
        """The output ended: keep a last line without its newline."""
        if self._partial:
            self.lines.append(self._partial.decode("utf-8", "replace"))
            self._partial = b""

    def text(self) -> str:
        return "\n".join(self.lines)
