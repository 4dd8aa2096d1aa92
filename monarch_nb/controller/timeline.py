"""The timeline: every command's start and end, per rank and stream, in a bounded
ring on the controller (``mesh.timeline()``).

Workers report what their streams finished (``Timings``, with their progress, at
most 10 times a second) in their own wall clock. The lease holder keeps each report
as it came, one batch, so that recording costs one append per report, not per
command; reading converts the times to the controller's clock with the offsets
``clocks.py`` measured, and marks the stragglers.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque

DEFAULT_SIZE = 100_000  # the setting timeline_size's default
STRAGGLER_FACTOR = 1.5
STRAGGLER_MIN_SECONDS = 0.001  # a command shorter than this is noise, never a straggler

_COLLECTIVE = ("reduce", "to_mesh", "send_tensor", "all_", "broadcast", "barrier")


def kind_of(what: str) -> str:
    """What a command is, from the name it was sent with: "cell", "op" (a tensor op
    such as ``aten.add``), "collective", "fetch", "push", "exec" or "call" (a remote
    function)."""
    if what.startswith(("cell", "%%monarch")):  # mesh.run_cell's, or a notebook cell's label
        return "cell"
    if what.startswith("aten.") or what.startswith("getitem"):
        return "op"
    if what.startswith(_COLLECTIVE):
        return "collective"
    if what == "fetch" or what.startswith("pull "):
        return "fetch"
    if what == "push":
        return "push"
    if what.startswith("exec"):
        return "exec"
    return "call"


def stragglers(records: list, factor: float = STRAGGLER_FACTOR, floor: float = 0.0) -> set:
    """Indices of the records (dicts with rank, stream, ident, start, end) whose command
    took more than ``factor`` times the median duration of the same command (same
    stream and ident) on its peers (the other ranks that ran it), and at least
    ``floor`` seconds. A command that ran on one rank has no peers: no straggler."""
    by_command: dict = {}
    for i, r in enumerate(records):
        by_command.setdefault((r["stream"], r["ident"]), []).append(i)
    out = set()
    for idx in by_command.values():
        if len(idx) < 2:
            continue
        took = [records[i]["end"] - records[i]["start"] for i in idx]
        for j, i in enumerate(idx):
            peers = took[:j] + took[j + 1 :]
            if took[j] > factor * statistics.median(peers) and took[j] >= floor:
                out.add(i)
    return out


class Timeline:
    """The last ``size`` command records of a mesh (the lease holder adds, callers read)."""

    def __init__(self, size: int = DEFAULT_SIZE):
        self._lock = threading.Lock()
        self._batches: deque = deque()  # (rank, stream, idents, whats, starts, ends)
        self._count = 0
        self._size = _check_size(size)
        self.offsets: dict[int, tuple] = {}  # rank -> (worker clock - ours, its round trip)

    @property
    def size(self) -> int:
        """How many records the ring keeps (the oldest go first)."""
        return self._size

    @size.setter
    def size(self, n: int) -> None:
        with self._lock:
            self._size = _check_size(n)
            self._trim()

    def add(self, rank: int, streams: tuple) -> None:
        """A worker's Timings: ``(stream, idents, whats, starts, ends)`` per stream (the
        numbers packed in arrays: 8 bytes each, not a Python object, ~100 B, a record)."""
        with self._lock:
            for sid, idents, whats, starts, ends in streams:
                batch = (rank, sid, idents, whats, starts, ends)
                self._batches.append(batch)
                self._count += len(idents)
            self._trim()

    def _trim(self) -> None:
        batches, size = self._batches, self._size
        while self._count > size:
            rank, sid, idents, whats, starts, ends = batches[0]
            extra = self._count - size
            if extra >= len(idents):
                batches.popleft()
                self._count -= len(idents)
            else:  # keep the newest part of the oldest batch
                cut = (idents[extra:], whats[extra:], starts[extra:], ends[extra:])
                batches[0] = (rank, sid, *cut)
                self._count -= extra

    def __len__(self) -> int:
        return self._count

    def clear(self) -> None:
        """Forget every record and offset (a restart: new workers, new clocks)."""
        with self._lock:
            self._batches.clear()
            self._count = 0
            self.offsets = {}

    def records(
        self,
        last: int | None = None,
        stream_names: dict | None = None,
        ranks=None,
        since: float | None = None,
    ) -> list[dict]:
        """The records (of ``ranks``, default all) as plain dicts, ordered by start (the
        controller's clock, s): rank, stream, ident, kind, name, start, end, and
        straggler (``stragglers``, among the records returned); the ``last`` ones only,
        when given; with ``since``, only those that ended then or later (a batch that
        ended before is skipped whole: a live view reads its window, not the ring)."""
        with self._lock:
            batches = list(self._batches)
            offsets = dict(self.offsets)
        names = stream_names or {}
        out = []
        keep = None if ranks is None else set(ranks)
        for rank, sid, idents, whats, starts, ends in batches:
            if keep is not None and rank not in keep:
                continue
            shift = offsets.get(rank, (0.0, 0.0))[0]
            if since is not None and max(ends) - shift < since:
                continue
            stream = names.get(sid, str(sid))
            for ident, what, start, end in zip(idents, whats, starts, ends):
                if since is not None and end - shift < since:
                    continue
                out.append(
                    {
                        "rank": rank,
                        "stream": stream,
                        "ident": ident,
                        "kind": kind_of(what),
                        "name": what,
                        "start": start - shift,
                        "end": end - shift,
                    }
                )
        out.sort(key=lambda r: (r["start"], r["rank"]))
        slow = stragglers(out, floor=STRAGGLER_MIN_SECONDS)
        for i, r in enumerate(out):
            r["straggler"] = i in slow
        if last is not None:
            out = out[max(0, len(out) - last) :] if last else []
        return out


def _check_size(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"the timeline's size must be a positive int, got {n!r}")
    return n


def check_last(last) -> int | None:
    """``last`` of ``mesh.timeline(last=...)``: None or an int >= 0."""
    if last is None:
        return None
    if isinstance(last, bool) or not isinstance(last, int) or last < 0:
        raise ValueError(f"timeline(last=...) takes None or an int >= 0, got {last!r}")
    return last
