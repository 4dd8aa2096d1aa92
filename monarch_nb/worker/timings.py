"""The commands a worker's streams finished since its last report, as one Timings
record (sent by the receiver with its progress, at most 10 times a second)."""

from __future__ import annotations

from array import array

from ..protocol import messages as m


class FinishedCommands:
    """A stream's finished commands, wall clock, until the receiver reports them: four
    columns, so that recording one allocates nothing (a tuple per command would, and
    the garbage collector would pay for it). The stream records a command with the
    four functions of ``record`` (the columns' bound appends: ident, what, start, end,
    called in that order); ``take`` (the receiver) counts the ends first, so each
    command it cuts has all four, and what the stream adds meanwhile stays for the
    next take. No lock: each append and each cut is one C call under the GIL."""

    __slots__ = ("idents", "whats", "starts", "ends", "record", "_appends", "keep")

    def __init__(self, keep: int):
        self.keep = keep  # records waiting at most
        self.idents, self.whats = array("q"), []
        self.starts, self.ends = array("d"), array("d")
        self._appends = (
            self.idents.append,
            self.whats.append,
            self.starts.append,
            self.ends.append,
        )
        self.record = self._appends

    @property
    def room(self) -> bool:
        return self.record is self._appends

    def check(self) -> tuple:
        """The stream's look, every few hundred commands: is there room? While
        ``keep`` records wait, ``record`` drops (a receiver that falls behind loses
        the newest records, never memory). Returns ``record``."""
        self.record = self._appends if len(self.ends) < self.keep else _DROP
        return self.record

    def take(self) -> tuple | None:
        """``(idents, whats, starts, ends)`` of the commands finished so far, or None."""
        n = len(self.ends)
        if not n:
            return None
        out = (self.idents[:n], self.whats[:n], self.starts[:n], self.ends[:n])
        del self.idents[:n], self.whats[:n], self.starts[:n], self.ends[:n]
        return out

    def __len__(self) -> int:
        return len(self.ends)


def _drop(_value) -> None:
    pass


_DROP = (_drop, _drop, _drop, _drop)


def take_timings(rank: int, streams) -> m.Timings | None:
    """Timings of what ``streams`` finished since the last call (None: nothing); the
    numbers go packed (arrays pickle as bytes) and the Timeline keeps them so."""
    out = []
    for s in streams:
        taken = s.times.take()
        if taken is not None:
            out.append((s.id, *taken))
    return m.Timings(rank, tuple(out)) if out else None
