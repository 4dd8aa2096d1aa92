"""The part of a cell's output that changes in place: lines still being written
(a tqdm bar, progress dots) and, past the cell's cap, the latest lines of each rank.

Both are drawn in one display of the cell (``display_data`` with a display id,
then ``update_display_data``), one row per rank (equal rows folded), so a
progress bar on 16 ranks is 16 updating lines, not a line per update. Carriage
returns mean what they mean in a terminal and in Jupyter's own stream output:
text after a ``\\r`` overwrites the line from its first column.
"""

from __future__ import annotations

import itertools
import os
from collections import deque

from ..controller import format_ranks

TAIL_LINES = 20  # past the cap: the latest lines kept per rank and stream name
TAIL_LINE_MAX = 2000  # characters of one such line shown
LIVE_AFTER = 0.2  # seconds a line must be in progress before it gets the live display

_ids = itertools.count()


def overwrite(text: str) -> str:
    """``text`` (one line, no newline) after its carriage returns: each segment
    overwrites the line from column 0. A trailing ``\\r`` is kept: the next text
    written overwrites what is there."""
    if "\r" not in text:
        return text
    parts = text.split("\r")
    line = parts[0]
    for seg in parts[1:]:
        if seg:
            line = seg + line[len(seg) :]
    return line + "\r" if text.endswith("\r") else line


def compact(text: str) -> str:
    """``text`` (a line still being written) in a short form that reads the same:
    every segment but the last collapsed, the last kept after its ``\r`` so that
    text written next continues it (where a cut between two writes fell)."""
    i = text.rfind("\r")
    if i <= 0:
        return text
    return overwrite(text[:i]).rstrip("\r") + text[i:]


def finished(line: str) -> str:
    """A line ended by a newline, as it reads (``\\r\\n`` is a plain newline)."""
    return overwrite(line).rstrip("\r")


def human_bytes(n: int) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} bytes"


def fold_rows(rows: dict) -> list[str]:
    """rank -> text (or a tuple of lines)  ==>  ``[ranks 0-3] text`` lines, equal ones folded."""
    groups: dict = {}
    for rank in sorted(rows):
        groups.setdefault(rows[rank], []).append(rank)
    out = []
    for value, ranks in groups.items():
        label = f"[{format_ranks(ranks)}]"
        for line in value if isinstance(value, tuple) else (value,):
            out.append(f"{label} {line}")
    return out


class Tails:
    """Past the cap: the latest TAIL_LINES lines of every (stream name, rank)."""

    def __init__(self):
        self._lines: dict[str, dict[int, deque]] = {}
        self.elided_lines = 0
        self.elided_bytes = 0

    def add(self, name: str, rank: int, text: str) -> None:
        if len(text) > TAIL_LINE_MAX:
            text = f"{text[:TAIL_LINE_MAX]}[... {len(text) - TAIL_LINE_MAX} more characters]"
        d = self._lines.setdefault(name, {}).setdefault(rank, deque())
        d.append(text)
        if len(d) > TAIL_LINES:
            old = d.popleft()
            self.elided_lines += 1
            self.elided_bytes += len(old) + 1

    def rows(self) -> list[str]:
        head = "[... the cell's output passed its cap"
        if self.elided_lines:
            head += (
                f": {self.elided_lines} lines ({human_bytes(self.elided_bytes)}) elided; "
                f"the latest lines of each rank follow"
            )
        out = [head + " ...]"]
        for name in sorted(self._lines, key=lambda n: (n != "stdout", n)):
            out.extend(fold_rows({r: tuple(d) for r, d in self._lines[name].items()}))
        return out


class LiveDisplay:
    """One cell's updating display: shown when first needed, updated when its text
    changes; once its rows are all done it is given up, so the next progress
    bar gets a display below whatever was printed in between."""

    def __init__(self, publisher, parent):
        self.publisher = publisher
        self.parent = parent
        self.id: str | None = None
        self.sent = ""
        self.stream_after = False  # stream text went out below the display

    @property
    def shown(self) -> bool:
        return self.id is not None

    def show(self, text: str) -> None:
        self.id = f"mnb-live-{os.getpid()}-{next(_ids)}"
        self.sent = text
        self.stream_after = False
        self.publisher.display(self.parent, {"text/plain": text}, display_id=self.id)

    def update(self, text: str) -> bool:
        if text == self.sent:
            return False
        self.sent = text
        self.publisher.update_display(self.parent, {"text/plain": text}, self.id)
        return True

    def release(self) -> None:
        self.id = None
        self.sent = ""
