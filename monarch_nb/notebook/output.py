"""Worker output to the right cell: per-cell sinks, rank folding, coalescing.

The controller's IO thread hands every Output message to the mesh's
``OutputRouter``, which puts it into the sink of the cell whose command
printed it (by ident), or into the mesh's ambient sink (output of remote
functions and other commands), which publishes under whichever cell runs.

A sink keeps complete lines per stream name and rank. Every TICK the ticker
thread publishes what is ready as at most one ``stream`` message per stream
name and cell, each line prefixed ``[rank r]``; identical lines printed by
several ranks fold into one ``[ranks 0-3]`` line. A line waits up to HOLD
seconds for the other ranks to print theirs, so that lockstep output folds.

Volume is bounded: a tick publishes at most BYTES_PER_TICK in all (well under
the 1 MB/s IOPub limit of Jupyter), at most PENDING_CAP bytes wait in a sink,
and a cell publishes at most CELL_CAP bytes (the ambient sink, which lives as
long as its mesh, only the rate limit); what does not fit is dropped and
replaced by a ``[... N bytes of output dropped ...]`` line where it was.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque

from ..controller import format_ranks
from .publish import Publisher, Ticker

HOLD = 0.3  # seconds a line waits for the same line from the other ranks
BYTES_PER_TICK = 48 << 10  # all sinks together, per tick (<= 480 KB/s)
PENDING_CAP = 128 << 10  # per sink: beyond this, incoming output is dropped
CELL_CAP = 512 << 10  # per cell: bytes published before everything else is dropped
LONG_LINE = 16 << 10  # an unterminated line this long is published as it is
MAX_MESSAGES_PER_TICK = 40  # all sinks together (<= 400 stream messages/s)


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
        self._capped = False  # CELL_CAP reached: dropping everything
        self._after_cap: dict = {}  # (name, rank) -> bytes dropped after the cap
        self.published = 0  # bytes of text published
        self.dropped = 0  # bytes dropped in all
        self.messages = 0  # stream messages published

    # ------------------------------------------------------------ IO thread

    def add(self, rank: int, name: str, text: str) -> None:
        if not text:
            return
        now = time.monotonic()
        with self.lock:
            queues = self._queues.setdefault(name, {})
            q = queues.get(rank)
            if q is None:
                q = queues[rank] = deque()
                self._counts.setdefault(name, {})[rank] = Counter()
            counts = self._counts[name][rank]
            partials = self._partial.setdefault(name, {})
            n = len(text)
            if self._capped:
                self._after_cap[(name, rank)] = self._after_cap.get((name, rank), 0) + n
                self.dropped += n
                return
            backlog = self._pending + self._partial_bytes
            cost = n + _prefix_len(rank) * (text.count("\n") + 1)
            if self.ranks is not None and self.published + backlog + cost > CELL_CAP:
                # enough for one cell: say so where it happened; the counts come at the end
                self._capped = True
                self._line_from_partial(q, counts, partials, rank)
                notice = (
                    f"[... this cell's output passed {CELL_CAP >> 10} KB: the rest is dropped ...]"
                )
                self._enqueue(q, counts, rank, now, notice)
                self._after_cap[(name, rank)] = n
                self.dropped += n
                return
            if self._shedding and backlog < PENDING_CAP // 4:
                self._shedding = False
            if self._shedding or backlog + cost > PENDING_CAP:
                # more than the notebook takes: drop until the backlog has drained
                self._shedding = True
                self._line_from_partial(q, counts, partials, rank)
                self._drop(q, now, n)
                return
            t0, rest = partials.pop(rank, (now, ""))
            self._partial_bytes -= len(rest)
            pieces = (rest + text).split("\n")
            rest = pieces.pop()
            for i, line in enumerate(pieces):
                self._enqueue(q, counts, rank, t0 if i == 0 else now, line)
            while len(rest) > LONG_LINE:
                self._enqueue(q, counts, rank, now, rest[:LONG_LINE])
                rest = rest[LONG_LINE:]
            if rest:
                partials[rank] = (t0 if not pieces else now, rest)
                self._partial_bytes += len(rest)

    def _enqueue(self, q: deque, counts: Counter, rank: int, t: float, text: str) -> None:
        line = _Line(t, text, 0, _prefix_len(rank) + len(text) + 1)
        q.append(line)
        counts[text] += 1
        self._pending += line.cost

    def _line_from_partial(self, q: deque, counts: Counter, partials: dict, rank: int) -> None:
        part = partials.pop(rank, None)
        if part is not None:
            self._partial_bytes -= len(part[1])
            if part[1]:
                self._enqueue(q, counts, rank, part[0], part[1])

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
            or self._partial_bytes > 0
            or any(q for qs in self._queues.values() for q in qs.values())
        )

    def tick(self, now: float, budget: int) -> int:
        """Publish what is ready; returns the number of messages sent."""
        with self.lock:
            if self.closed:
                return 0
            return self._publish(self._collect(now, False, budget))

    def finish(self) -> None:
        """Publish everything left (the command ended); no more ticks."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            now = time.monotonic()
            for (name, rank), n in sorted(self._after_cap.items()):
                self._queues[name][rank].append(_Line(now, "", n))
            self._after_cap.clear()
            self._publish(self._collect(now, True, 0))

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
            partials = self._partial.get(name, {})
            for rank, (t, rest) in list(partials.items()):
                if final or now - t >= HOLD:
                    del partials[rank]
                    self._partial_bytes -= len(rest)
                    self._enqueue(queues[rank], counts[rank], rank, t, rest)
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


class OutputRouter:
    """The ``on_output`` hook of one mesh's controller: Output -> the cell's sink."""

    def __init__(self, hub: OutputHub, controller):
        self.hub = hub
        self.controller = controller
        self.sinks: dict[int, CellSink] = {}
        self.ambient = CellSink(hub.publisher, None, None)
        hub.live.add(self.ambient)
        controller.on_output = self.on_output
        self.blocking: set[int] = set()  # idents of cells that wait, and so serve pauses inline
        controller.debugger.listeners.append(self.on_debugger)

    def on_output(self, msg) -> None:
        sink = self.sinks.get(msg.ident) if msg.ident is not None else None
        if sink is None or sink.closed:
            sink = self.ambient
        sink.add(msg.rank, msg.name, msg.text)

    def on_debugger(self, event: str, session) -> None:
        """A pause no inline prompt serves gets a one-line notice pointing to
        ``%monarch_debug``: under the cell that paused (``--noblock``), else under
        the cell that runs as it begins. It is decided at the next tick (when a
        blocking cell has claimed its pauses) and published only while the pause
        is still on: a pause over by then, or asked for (post-mortem), says nothing."""
        if event != "paused" or session.requested:
            return
        parent = self.hub.publisher.current_parent()  # the cell current as the pause begins
        debugger = self.controller.debugger

        def tell() -> None:
            if session.ident in self.blocking or not debugger.claim_notice(session):
                return
            loc = session.location
            line = (
                f"paused in the debugger ({session.stream_name}) at {loc.get('file')}:"
                f"{loc.get('line')} in {loc.get('function')}: serve it with %monarch_debug "
                f"or the dashboard's debugger panel\n"
            )
            sink = self.sinks.get(session.ident) if session.ident is not None else None
            if sink is not None and not sink.closed:
                sink.add(session.rank, "stderr", line)  # in order with the cell's output
            else:
                once = CellSink(self.hub.publisher, parent, None)
                once.add(session.rank, "stderr", line)
                once.finish()

        self.hub.ticker.call_soon(tell)

    def register(self, ident: int, sink: CellSink) -> None:
        self.sinks[ident] = sink
        self.hub.live.add(sink)

    def unregister(self, ident: int) -> None:
        sink = self.sinks.pop(ident, None)
        if sink is not None:
            self.hub.live.discard(sink)


class OutputHub:
    """The publisher, the ticker thread and every live sink of this kernel."""

    def __init__(self, publisher: Publisher):
        self.publisher = publisher
        self.ticker = Ticker()
        self.live: set[CellSink] = set()
        self._routers: dict[int, OutputRouter] = {}
        self._lock = threading.Lock()
        self._token = self.ticker.add(self._tick)

    def router(self, controller) -> OutputRouter:
        with self._lock:
            r = self._routers.get(id(controller))
            if r is None or r.controller is not controller:
                r = self._routers[id(controller)] = OutputRouter(self, controller)
            elif controller.on_output != r.on_output:
                controller.on_output = r.on_output
            return r

    def forget(self, controller) -> None:
        with self._lock:
            r = self._routers.pop(id(controller), None)
        if r is not None:
            r.ambient.finish()
            self.live.discard(r.ambient)

    def _tick(self, now: float) -> None:
        sinks = [s for s in list(self.live) if s.has_pending]
        if not sinks:
            return
        budget = max(1024, BYTES_PER_TICK // len(sinks))
        sent = 0
        for s in sorted(sinks, key=id):
            if sent >= MAX_MESSAGES_PER_TICK:
                break
            sent += s.tick(now, budget)

    def close(self) -> None:
        """Stop publishing; the controllers print their output again (as in scripts)."""
        from ..controller.controller import print_output

        self.ticker.remove(self._token)
        with self._lock:
            routers, self._routers = list(self._routers.values()), {}
        for r in routers:
            if r.controller.on_output == r.on_output:
                r.controller.on_output = print_output
            r.ambient.finish()
            self.live.discard(r.ambient)
