"""The commands of one stream that ``mesh.status()`` counts per rank (queued,
running), grouped by the ranks they went to: a rank's queue is then a few
binary searches over the idents of its groups, not a walk of every command (a
pipelined loop leaves thousands in flight, and the dashboard asks ten times a
second)."""

from __future__ import annotations

from bisect import bisect_left, bisect_right


class SentGroups:
    """``entries`` (``(ident, ranks, what, sent_at)``, in the order they were sent)
    by their ranks: one group per ranks tuple."""

    __slots__ = ("_groups",)

    def __init__(self, entries):
        by_id: dict = {}  # one mesh's commands share its targets tuple: found by identity
        by_value: dict = {}
        groups: list = []
        last_t = g = None
        for e in entries:
            t = e[1]
            if t is not last_t:
                g = by_id.get(id(t))
                if g is None:
                    g = by_value.get(t)
                    if g is None:
                        # [ranks, idents, entries, idents ascending]
                        g = by_value[t] = [frozenset(t), [], [], True]
                        groups.append(g)
                    by_id[id(t)] = g
                last_t = t
            idents = g[1]
            if idents and e[0] <= idents[-1]:
                g[3] = False  # two threads sent out of ident order: this group is walked
            idents.append(e[0])
            g[2].append(e)
        self._groups = groups

    def of(self, rank: int, started: int, finished: int) -> tuple:
        """``(queued, running)`` for ``rank`` whose stream last started ``started`` and
        finished ``finished``: the commands after both, and the entry of the one it
        runs (None when it runs nothing of these)."""
        queued, running = 0, None
        after = max(started, finished)
        for ranks, idents, entries, ascending in self._groups:
            if rank not in ranks:
                continue
            if ascending:
                if started > finished:
                    i = bisect_left(idents, started)
                    if i < len(idents) and idents[i] == started:
                        running = entries[i]
                queued += len(idents) - bisect_right(idents, after)
                continue
            for e in entries:
                if e[0] == started and started > finished:
                    running = e
                elif e[0] > after:
                    queued += 1
        return queued, running
