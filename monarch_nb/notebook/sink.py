"""A cell's output on its way to the notebook: lines per rank and stream name,
folded over ranks, paced, capped (see ``output.py`` for the whole path).

A line waits up to HOLD seconds for the other ranks to print theirs, so that
lockstep output folds. Lines still being written (progress bars, ``\r``
updates) are drawn in place, one row per rank, by the cell's live display
(``live.py``); only the line a bar ends with is published. At most PENDING_CAP
bytes wait in a sink (beyond that a ``[... N bytes of output dropped ...]``
line stands where lines were dropped); a cell publishes at most CELL_CAP bytes
as stream text, after which the live display keeps the latest lines of every
rank to the end of the cell, with a notice of how much was elided.

``clear_output()`` on a rank (an output event named CLEAR) clears that rank's
part of the cell, as Jupyter clears a cell: the cell's output leaves the
frontend once, and from then on the live display draws each rank's *screen*,
the lines it printed since its last clear (``wait=True``: cleared when it next
prints), equal screens folded.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque

from ..controller import format_ranks
from .live import LIVE_AFTER, LiveDisplay, Tails, compact, finished, fold_rows
from .publish import Publisher

HOLD = 0.3  # seconds a line waits for the same line from the other ranks
CLEAR = "clear"  # the output name of a rank's clear_output() (text: "wait" or "now")
SCREEN_LINES = 200  # lines kept per rank after a clear (and before it, to draw them)
PENDING_CAP = 1 << 20  # per sink: beyond this, incoming output is dropped (above CELL_CAP:
# a cell keeps its latest lines past its cap instead, only the ambient sink sheds)
CELL_CAP = 512 << 10  # per cell: stream bytes published before only the latest lines show
LONG_LINE = 16 << 10  # an unterminated line this long is published as it is


def dropped_notice(n: int) -> str:
    return f"[... {n} bytes of output dropped ...]"


class _Line:
    __slots__ = ("t", "text", "dropped", "cost")

    def __init__(self, t: float, text: str, dropped: int = 0, cost: int = 0):
        self.t = t
        self.text = text
        self.dropped = dropped
        self.cost = cost  # bytes it takes published on its own, prefix included


def _prefix_len(rank: int) -> int:
    return len(f"[rank {rank}] ")


class CellSink:
    """The output of one cell's command on its ranks (or, ``ranks=None``, of
    anything else on a mesh), published under ``parent`` (None: the current cell)."""

    def __init__(self, publisher: Publisher, parent, ranks=None):
        self.publisher = publisher
        self.parent = parent
        self.ranks = None if ranks is None else tuple(ranks)
        self.lock = threading.Lock()
        self.closed = False
        self._queues: dict[str, dict[int, deque]] = {}
        self._counts: dict[str, dict[int, Counter]] = {}  # texts queued, for folding
        self._partial: dict[str, dict[int, tuple[float, str]]] = {}
        self._pending = 0  # bytes the queued lines take published (an upper bound)
        self._partial_bytes = 0
        self._shedding = False  # dropping output until the backlog drains
        self._tails: Tails | None = None  # CELL_CAP reached: only the latest lines show
        self._live = LiveDisplay(publisher, parent)
        self._live_dirty = False
        self._live_names: set[str] = set()  # stream names with rows in the live display
        self._history: dict[int, deque] = {}  # each rank's latest lines, until a clear
        self._screens: dict[int, deque] | None = None  # after a clear: each rank's lines
        self._clear_waits: set[int] = set()  # ranks cleared when they next print
        self._clear_frontend = False  # the cell's output is to leave the frontend
        self.published = 0  # bytes of text published
        self.dropped = 0  # bytes dropped in all
        self.messages = 0  # stream messages published

    # ------------------------------------------------------------ IO thread

    def add(self, rank: int, name: str, text: str) -> None:
        if not text:
            return
        now = time.monotonic()
        with self.lock:
            if name == CLEAR:
                self._clear(rank, text == "wait")
                return
            if rank in self._clear_waits:
                self._clear_waits.discard(rank)
                self._screens[rank] = deque()
            queues = self._queues.setdefault(name, {})
            if rank not in queues:
                queues[rank] = deque()
                self._counts.setdefault(name, {})[rank] = Counter()
            partials = self._partial.setdefault(name, {})
            t0, rest = partials.pop(rank, (now, ""))
            self._partial_bytes -= len(rest)
            pieces = (rest + text).split("\n")
            rest = compact(pieces.pop())
            for i, line in enumerate(pieces):
                self._line(name, rank, t0 if i == 0 else now, finished(line))
            if len(rest) > LONG_LINE:
                rest = finished(rest)
                while len(rest) > LONG_LINE:
                    self._line(name, rank, now, rest[:LONG_LINE])
                    rest = rest[LONG_LINE:]
            if rest:
                partials[rank] = (t0 if not pieces else now, rest)
                self._partial_bytes += len(rest)
            self._live_dirty = True

    def _clear(self, rank: int, wait: bool) -> None:
        """Rank ``rank`` cleared its output (in a kernel: elsewhere nothing is redrawn)."""
        if self.ranks is None or not getattr(self.publisher, "in_kernel", False):
            return
        if self._screens is None:  # the first clear: what is queued is drawn, not published
            for queues in self._queues.values():
                for r, q in queues.items():
                    for line in q:
                        if not line.dropped:
                            self._history.setdefault(r, deque(maxlen=SCREEN_LINES)).append(line.text)
                    q.clear()
                self._counts = {n: {r: Counter() for r in qs} for n, qs in self._queues.items()}
            self._pending = 0
            self._screens = {r: deque(h, maxlen=SCREEN_LINES) for r, h in self._history.items()}
            self._clear_frontend = True
        if wait:
            self._clear_waits.add(rank)
        else:
            self._screens[rank] = deque(maxlen=SCREEN_LINES)
        self._live_dirty = True

    def _line(self, name: str, rank: int, t: float, text: str) -> None:
        """One complete line: queued, or past the cap kept among the latest, or shed."""
        if self._screens is not None:
            self._screens.setdefault(rank, deque(maxlen=SCREEN_LINES)).append(text)
            return
        if self.ranks is not None:
            self._history.setdefault(rank, deque(maxlen=SCREEN_LINES)).append(text)
        if self._tails is not None:
            self._tails.add(name, rank, text)
            return
        q, counts = self._queues[name][rank], self._counts[name][rank]
        cost = _prefix_len(rank) + len(text) + 1
        if self.ranks is not None and self.published + self._pending + cost > CELL_CAP:
            self._tails = Tails()
            notice = (
                f"[... this cell's output passed {CELL_CAP >> 10} KB: the latest lines "
                f"of each rank show below, to the end of the cell ...]"
            )
            self._enqueue(q, counts, rank, t, notice)
            self._tails.add(name, rank, text)
            return
        backlog = self._pending
        if self._shedding and backlog < PENDING_CAP // 4:
            self._shedding = False
        if self._shedding or backlog + cost > PENDING_CAP:
            # more than the notebook takes: drop until the backlog has drained
            self._shedding = True
            self._drop(q, t, len(text) + 1)
            return
        self._enqueue(q, counts, rank, t, text)

    def _enqueue(self, q: deque, counts: Counter, rank: int, t: float, text: str) -> None:
        line = _Line(t, text, 0, _prefix_len(rank) + len(text) + 1)
        q.append(line)
        counts[text] += 1
        self._pending += line.cost

    def _drop(self, q: deque, now: float, n: int) -> None:
        self.dropped += n
        if q and q[-1].dropped:
            q[-1].dropped += n
        else:
            q.append(_Line(now, "", n))

    # ------------------------------------------------------------ publishing

    @property
    def has_pending(self) -> bool:
        return (
            self._pending > 0
            or self._live_dirty
            or self._partial_bytes > 0
            or any(q for qs in self._queues.values() for q in qs.values())
        )

    def tick(self, now: float, budget: int) -> int:
        """Publish what is ready; returns the number of messages sent."""
        with self.lock:
            if self.closed:
                return 0
            return self._emit(self._collect(now, False, budget), now, False)

    def finish(self) -> None:
        """Publish everything left (the command ended); no more ticks."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            now = time.monotonic()
            for name, partials in self._partial.items():
                for rank, (t, rest) in sorted(partials.items()):
                    if finished(rest):
                        self._line(name, rank, t, finished(rest))
                partials.clear()
            self._partial_bytes = 0
            self._emit(self._collect(now, True, 0), now, True)

    def _screen_rows(self) -> list[str]:
        """After a clear: each rank's screen and its line in progress, equal ones folded."""
        screens = {r: list(lines) for r, lines in self._screens.items()}
        for partials in self._partial.values():
            for r, (_, rest) in partials.items():
                if finished(rest) and r not in self._clear_waits:
                    screens.setdefault(r, []).append(finished(rest))
        return fold_rows({r: tuple(lines) for r, lines in screens.items() if lines})

    def _emit_screens(self, final: bool) -> int:
        """Draw the screens in the live display (after the frontend cleared the cell)."""
        live, sent = self._live, 0
        if self._clear_frontend:
            self.publisher.clear_output(self.parent, wait=True)
            live.release()
            self._clear_frontend, sent = False, 1
        if not (self._live_dirty or final):
            return sent
        self._live_dirty = False
        text = "\n".join(self._screen_rows())
        if live.shown:
            return sent + live.update(text)
        if text:
            live.show(text)
            sent += 1
        return sent

    def _live_rows(self) -> list[str]:
        rows = self._tails.rows() if self._tails is not None else []
        for name in sorted(self._partial, key=lambda n: (n != "stdout", n)):
            shown = {r: finished(rest) for r, (_, rest) in self._partial[name].items()}
            shown = {r: t for r, t in shown.items() if t}
            if shown:
                self._live_names.add(name)
                rows.extend(fold_rows(shown))
        return rows

    def _emit(self, texts: dict, now: float, final: bool) -> int:
        """Publish ``texts`` (stream name -> text) and bring the live display up to date."""
        live = self._live
        if self._screens is not None:
            return self._emit_screens(final) + self._publish(texts)
        if not getattr(self.publisher, "in_kernel", False):  # no displays to redraw
            sent = self._publish(texts)
            if final and self._tails is not None:
                sent += self._publish({"stdout": "\n".join(self._tails.rows()) + "\n"})
            return sent
        rows = self._live_rows() if self._live_dirty or final else None
        self._live_dirty = False
        if rows == [] and live.shown and not live.stream_after and self._tails is None:
            if not texts and self._pending and not final:
                self._live_dirty = True  # the ended lines wait to fold: look again
                return 0
        ended = {n: texts.pop(n) for n in self._live_names if n in texts}
        if rows == [] and live.shown and not live.stream_after and ended and self._tails is None:
            # the lines in progress ended with nothing printed below them: the lines
            # they became take the display's place (other streams' text goes below)
            live.update("".join(ended[n] for n in sorted(ended, key=lambda n: (n != "stdout", n))))
            live.release()
            self._live_names.clear()
            self.published += sum(len(t) for t in ended.values())
            return 1 + self._publish(texts)
        texts.update(ended)
        sent = self._publish(texts)
        if texts and live.shown:
            live.stream_after = True
        if rows is None:
            return sent
        text = "\n".join(rows)
        if live.shown:
            sent += live.update(text)
            if not rows and self._tails is None:
                live.release()
                self._live_names.clear()
        elif rows and (final or self._tails is not None or self._ready_for_live(now)):
            live.show(text)
            sent += 1
        else:
            self._live_dirty = bool(rows)  # not yet: look again next tick
            if not rows:
                self._live_names.clear()
        return sent

    def _ready_for_live(self, now: float) -> bool:
        """A line has been in progress a while, and every line before it is out."""
        if self._pending:
            return False
        starts = [t for ps in self._partial.values() for t, _ in ps.values()]
        return bool(starts) and now - min(starts) >= LIVE_AFTER

    def _publish(self, texts: dict) -> int:
        for name, text in texts.items():
            self.publisher.stream(self.parent, name, text)
            self.published += len(text)
            self.messages += 1
        return len(texts)

    def _collect(self, now: float, final: bool, budget: int) -> dict:
        out = {}
        used = 0
        for name in sorted(self._queues, key=lambda n: (n != "stdout", n)):
            queues = self._queues[name]
            counts = self._counts[name]
            lines: list[str] = []
            while True:
                heads = {r: q[0] for r, q in queues.items() if q}
                if not heads:
                    break
                if not final:
                    waiting = self.ranks is not None and any(r not in heads for r in self.ranks)
                    if waiting and now - min(h.t for h in heads.values()) < HOLD:
                        break
                    if used >= budget:
                        break
                ranks = self._next_group(heads, counts)
                h = heads[ranks[0]]
                text = dropped_notice(h.dropped) if h.dropped else h.text
                line = f"[{format_ranks(ranks)}] {text}\n"
                lines.append(line)
                used += len(line)
                for r in ranks:
                    popped = queues[r].popleft()
                    if not popped.dropped:
                        self._pending -= popped.cost
                        c = counts[r]
                        c[popped.text] -= 1
                        if not c[popped.text]:
                            del c[popped.text]
            if lines:
                out[name] = "".join(lines)
        return out

    @staticmethod
    def _next_group(heads: dict, counts: dict) -> list:
        """The ranks whose head lines go out next (as one folded line when several).

        Ranks with the same head line form a group. A group waits while another
        rank still has its line queued further back (that rank prints something
        else first: let it, then they fold); among the others, the biggest group
        goes first, ties to the lowest rank."""
        groups: dict = {}
        for r in sorted(heads):
            h = heads[r]
            groups.setdefault(("drop", r) if h.dropped else h.text, []).append(r)
        if len(groups) == 1:
            return next(iter(groups.values()))
        ready = []
        for key, ranks in groups.items():
            if isinstance(key, str) and any(counts[r][key] > 0 for r in heads if r not in ranks):
                continue
            ready.append(ranks)
        return max(ready or groups.values(), key=lambda rs: (len(rs), -rs[0]))
