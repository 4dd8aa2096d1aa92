"""The dashboard's view of a big mesh: a heat grid of hosts x ranks.

Pure functions from ``mesh.status()`` to HTML, like ``render.py``. One row per
host (the host a rank's ``status()`` names; on one host, the mesh's last dim
makes the rows), one small cell per rank coloured by its state on the chosen
stream (or on all of them), and one summary line per host. A host's row is
cached on what it shows, so a redraw where few ranks changed rebuilds few rows.
"""

from __future__ import annotations

import html
from functools import lru_cache

from . import render

GRID_ABOVE = render.BIG  # meshes with more ranks than this draw the grid (smaller: the table)
ALL = "*"  # the stream choice that draws every stream's worst state
MEMORY = "memory"  # the choice that colours each rank by its memory (GPU allocated, else RSS)

# cell state -> background (a queue's depth darkens its blue)
GRID_COLORS = {
    "idle": "#e4e4e4",
    "run": "#8cc4ff",
    "q1": "#4f9be8",
    "q2": "#2166c4",
    "q3": "#0b3d91",
    "paused": "#b36be0",
    "failed": "#e03c3c",
    "unresponsive": "#f0a020",
    "dead": "#555",
    "m1": "#d9f0d3",
    "m2": "#a6dba0",
    "m3": "#fdb863",
    "m4": "#e66101",
    "m5": "#b2182b",
}
LABELS = {
    "idle": "idle",
    "run": "running",
    "q1": "queued 1-3",
    "q2": "queued 4-15",
    "q3": "queued 16+",
    "paused": "paused in pdb",
    "failed": "failed",
    "unresponsive": "unresponsive",
    "dead": "dead",
    "m1": "memory < 20 % of the most",
    "m2": "20-50 %",
    "m3": "50-80 %",
    "m4": "80-95 %",
    "m5": "95 %+",
}
_MEMORY_STATES = ("m1", "m2", "m3", "m4", "m5")
# which state a rank shows when its streams differ (the worst first)
_RANK_ORDER = ("dead", "unresponsive", "paused", "failed", "q3", "q2", "q1", "run", "idle")
_WORST = {s: i for i, s in enumerate(_RANK_ORDER)}

_esc = html.escape
STYLE = (
    "<style>.mnb-grid{border-collapse:collapse;margin:4px 0}"
    ".mnb-grid td{padding:0 4px;white-space:nowrap;vertical-align:middle}"
    ".mnb-grid i,.mnb-g-legend i{display:inline-block;width:9px;height:9px;margin:0 1px 0 0;"
    "border-radius:1px}.mnb-g-legend i{margin-left:8px}"
    + "".join(f".mnb-grid-view i.g-{s}{{background:{c}}}" for s, c in GRID_COLORS.items())
    + "</style>"
)


def use_grid(status: dict) -> bool:
    """Whether the mesh is big enough for the grid (small ones keep the table)."""
    return len(status["ranks"]) > GRID_ABOVE


def streams_of(status: dict) -> list[str]:
    """The stream names, as the first rank reports them."""
    for w in status["ranks"].values():
        return list(w["streams"])
    return []


def stream_state(worker: dict, stream: dict, failed: bool) -> str:
    """A grid cell's state for one stream of one rank."""
    if not worker["alive"]:
        return "dead"
    if worker.get("unresponsive"):
        return "unresponsive"
    if stream.get("paused"):
        return "paused"
    q = stream["queued"]
    if q:
        return "q1" if q <= 3 else "q2" if q <= 15 else "q3"
    if stream["running"]:
        return "run"
    if failed:
        return "failed"
    return "idle"


def host_rows(status: dict) -> list[tuple[str, list[int]]]:
    """(host, its ranks) in rank order. One host for all: rows of the last dim."""
    ranks = status["ranks"]
    first, last = (ranks[min(ranks)], ranks[max(ranks)]) if ranks else ({}, {})
    # a mesh's hosts change only when it restarts: the key holds what tells
    key = (status.get("name"), status.get("generation"), len(ranks), first.get("host"))
    key += (last.get("host"), tuple(status["dims"].items()))
    rows = _ROWS.get(key)
    if rows is None:
        rows = _ROWS[key] = _host_rows(status)
        while len(_ROWS) > 64:
            del _ROWS[next(iter(_ROWS))]
    return rows


_ROWS: dict = {}


def _host_rows(status: dict) -> list[tuple[str, list[int]]]:
    rows: dict[str, list[int]] = {}
    for r, w in status["ranks"].items():
        rows.setdefault(str(w.get("host") or "-"), []).append(r)
    if len(rows) > 1:
        return list(rows.items())
    ranks = list(status["ranks"])
    dims = list(status["dims"].values())
    width = dims[-1] if dims and dims[-1] > 1 else 32
    name = rows and next(iter(rows)) or "-"
    return [(f"{name}:{i // width}", ranks[i : i + width]) for i in range(0, len(ranks), width)]


def memory_of(worker: dict) -> int | None:
    """A rank's memory in bytes: its GPU's allocated memory where it has one, else RSS."""
    gpu = worker.get("gpu") or {}
    return gpu.get("allocated", gpu.get("mem")) if gpu else worker.get("rss")


def memory_cells(status: dict) -> dict[int, tuple[int, str, int]]:
    """rank -> (rank, memory state: its share of the largest rank's, MB)."""
    mem = {r: memory_of(w) if w["alive"] else None for r, w in status["ranks"].items()}
    most = max((v for v in mem.values() if v), default=0) or 1
    out = {}
    for r, v in mem.items():
        if v is None:
            out[r] = (r, "dead" if not status["ranks"][r]["alive"] else "idle", 0)
            continue
        share = v / most
        k = 0 if share < 0.2 else 1 if share < 0.5 else 2 if share < 0.8 else 3 if share < 0.95 else 4
        out[r] = (r, _MEMORY_STATES[k], v >> 20)
    return out


def rank_cells(status: dict, stream: str = ALL) -> dict[int, tuple[int, str, int]]:
    """rank -> (rank, state, deepest queue) on ``stream`` (ALL: the worst of its streams;
    MEMORY: (rank, memory state, MB))."""
    if stream == MEMORY:
        return memory_cells(status)
    failed = render.failed_streams(status) if status["errors"] else ()
    out = {}
    for r, w in status["ranks"].items():
        if not w["alive"]:
            out[r] = (r, "dead", 0)
            continue
        streams = w["streams"]
        if stream == ALL:
            items = streams.items()
        else:
            info = streams.get(stream)
            items = ((stream, info),) if info is not None else ()
        best, depth = "idle", 0
        for s, info in items:
            q = info["queued"]
            if q or info["running"] or info.get("paused") or failed:
                st = stream_state(w, info, (r, s) in failed)
                if _WORST[st] < _WORST[best]:
                    best = st
                if q > depth:
                    depth = q
        if w.get("unresponsive"):
            best = "unresponsive"
        out[r] = (r, best, depth)
    return out


@lru_cache(maxsize=512)
def host_row(host: str, cells: tuple, memory: bool = False) -> str:
    """One host's row: its summary line and a cell per rank. ``cells``: a tuple
    of (rank, state, queue depth; with ``memory``, MB), which keys the cache."""
    n = len(cells)
    alive = sum(1 for _, s, _ in cells if s != "dead")
    failed = sum(1 for _, s, _ in cells if s == "failed")
    busiest = max(cells, key=lambda c: c[2]) if cells else None
    parts = [f"<b>{_esc(host)}</b>", f"<span class='mnb-g-alive'>{alive}/{n} alive</span>"]
    if memory:
        if busiest is not None:
            parts.append(f"most memory {busiest[2]:,} MB (rank {busiest[0]})")
    elif busiest is not None and busiest[2]:
        parts.append(f"busiest queue {busiest[2]} (rank {busiest[0]})")
    else:
        parts.append("queues empty")
    if failed:
        parts.append(f"<span class='mnb-g-fails' style='color:{render.RED}'>{failed} failed</span>")
    # the smallest markup per rank (a 1,024-rank grid is sent whole on a change):
    # its state as a class, its rank first in the title
    unit = " MB" if memory else " queued"
    marks = "".join(
        f"<i class=g-{s} title='{r} {LABELS[s]}" + (f", {q}{unit}'></i>" if q else "'></i>")
        for r, s, q in cells
    )
    return (
        f"<tr class='mnb-grid-host' data-host='{_esc(host)}'><td class='mnb-g-summary'>"
        f"{' · '.join(parts)}</td><td class='mnb-g-cells'>{marks}</td></tr>"
    )


def legend_html(memory: bool = False) -> str:
    shown = [s for s in GRID_COLORS if (s in _MEMORY_STATES) == memory]
    return (
        "<div class='mnb-g-legend'>"
        + " ".join(f"<i class=g-{s}></i> {_esc(LABELS[s])}" for s in shown)
        + "</div>"
    )


def grid_html(status: dict, stream: str = ALL) -> str:
    """Hosts x ranks: a summary line and a row of cells per host."""
    cells = rank_cells(status, stream)
    memory = stream == MEMORY
    rows = [
        host_row(host, tuple(map(cells.__getitem__, ranks)), memory)
        for host, ranks in host_rows(status)
    ]
    shown = {ALL: "every stream (the worst)", MEMORY: "memory (GPU allocated, else RSS)"}
    shown = shown.get(stream, f"stream {stream}")
    return (
        f"<div class='mnb-grid-view'><b>ranks</b> · {_esc(shown)}{legend_html(memory)}"
        f"<table class='mnb-grid'>{''.join(rows)}</table></div>"
    )


def main_html(status: dict, state: str = "ok", stream: str = ALL) -> str:
    """The big mesh's main part: header and heat grid."""
    return (
        "<div class='mnb-status' style='font-family:monospace;font-size:12px'>"
        f"{render.STYLE}{STYLE}{render.header_html(status, state)}"
        f"{grid_html(status, stream)}</div>"
    )


def rank_detail_html(status: dict, rank: int) -> str:
    """One rank's queues and health: the small mesh's table, for that rank only."""
    w = status["ranks"].get(rank)
    if w is None:
        last = max(status["ranks"], default=-1)
        return (
            "<div class='mnb-rank-detail' style='font-family:monospace;font-size:12px'>"
            f"no rank {_esc(str(rank))} (ranks 0-{last})</div>"
        )
    one = {**status, "ranks": {rank: w}}
    return (
        "<div class='mnb-rank-detail' style='font-family:monospace;font-size:12px'>"
        f"{render.STYLE}<b>rank {rank}</b> ({_esc(str(w.get('host') or '-'))})"
        f"<div style='display:flex;gap:12px;flex-wrap:wrap;align-items:flex-start'>"
        f"<div><b>queues</b>{render.queues_html(one)}</div>"
        f"<div><b>worker</b>{render.health_html(one)}</div></div></div>"
    )
