"""The commands a worker's streams finished since its last report, as one Timings
record (sent by the receiver with its progress, at most 10 times a second)."""

from __future__ import annotations

from ..protocol import messages as m


def take_timings(rank: int, streams) -> m.Timings | None:
    """Timings of what ``streams`` finished since the last call (None: nothing)."""
    out = []
    for s in streams:
        q = s.times
        n = len(q)
        if not n:
            continue
        pop = q.popleft  # the stream appends meanwhile: take only the n there now
        batch = [pop() for _ in range(n)]
        idents, whats, starts, ends = zip(*batch)
        out.append((s.id, idents, whats, starts, ends))
    return m.Timings(rank, tuple(out)) if out else None
