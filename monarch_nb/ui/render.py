"""The dashboard's drawing: ``mesh.status()`` (plain data) -> HTML strings.

Pure functions, no widgets and no mesh: the dashboard calls them with one
snapshot per redraw and sends a widget update only when the text changed. So
that an idle mesh draws the same text twice in a row, nothing here shows a
continuously changing number: times are whole seconds, memory whole MB, and a
fresh heartbeat reads ``<2 s``.
"""

from __future__ import annotations

import html
import time

from ..controller import fold_by_rank as fold  # noqa: F401 - the panel's folded outputs
from ..controller import format_ranks
from ..controller.errors import group_by_traceback

HEARTBEAT_STALE = 5.0  # seconds without a word from a live worker: its heartbeat turns red
MAX_ERROR_GROUPS = 20  # distinct tracebacks listed (the newest)
MAX_TRACEBACK = 8000  # characters of a traceback kept (its end)
WHAT_CHARS = 36  # characters of a running command's description
BIG = 32  # ranks past which the views fold (the grid, the status line)

# cell state -> (background, text colour)
COLORS = {
    "idle": ("#f2f2f2", "#333"),
    "busy": ("#d6eaff", "#033"),
    "paused": ("#f0dcff", "#306"),
    "failed": ("#ffd6d6", "#700"),
    "dead": ("#c8c8c8", "#444"),
}
RED = "#c00"

_esc = html.escape


def mesh_state(status: dict, usable: bool, closed: bool) -> str:
    """``ok`` | ``shut down`` | ``broken`` | ``restarting`` (usable: the controller
    takes commands; closed: shut down for good)."""
    if closed:
        return "shut down"
    if usable:
        return "ok"
    if any(r["alive"] for r in status["ranks"].values()):
        return "broken"
    return "restarting"


def status_text(status: dict, state: str = "ok") -> str:
    """One line: ``mesh 'default': dp=2, gloo, 2/2 alive (pids 11, 12)``."""
    ranks = status["ranks"]
    alive = sum(1 for r in ranks.values() if r["alive"])
    dims = " ".join(f"{k}={v}" for k, v in status["dims"].items())
    what = f"{alive}/{len(ranks)} alive" if state != "shut down" else "shut down"
    if state in ("broken", "restarting"):
        what += f", {state}"
    if len(ranks) > BIG:  # a pid per rank would be a line of thousands of characters
        hosts = len({r.get("host") for r in ranks.values() if r["pid"]})
        procs = len({r["pid"] for r in ranks.values() if r["pid"]})
        where = f"{hosts} host{'s' * (hosts != 1)}, {procs} process{'es' * (procs != 1)}"
        return f"mesh {status['name']!r}: {dims}, {status['backend']}, {what} ({where})"
    pids = ", ".join(str(r["pid"]) for r in ranks.values() if r["pid"])
    return f"mesh {status['name']!r}: {dims}, {status['backend']}, {what} (pids {pids or '-'})"


def summary(status: dict, state: str = "ok") -> dict:
    """What the JupyterLab status item and panel show of a mesh (plain, JSON-able):
    its shape, workers alive, busy ranks (running a command, paused ones too),
    paused debugger sessions and the failures seen (one per rank and command)."""
    ranks = status["ranks"]
    sessions = status.get("debugger") or []
    out = {
        "name": status["name"],
        "generation": status.get("generation", 0),
        "shape": " ".join(f"{k}={v}" for k, v in status["dims"].items()),
        "backend": status["backend"],
        "state": state,
        "alive": sum(1 for r in ranks.values() if r["alive"]),
        "total": len(ranks),
        "dead": {
            str(r): w["exit"] or "gone"
            for r, w in ranks.items()
            if not w["alive"] and state != "shut down"
        },
        "busy": sorted(
            r
            for r, w in ranks.items()
            if w["alive"] and any(s["running"] or s.get("paused") for s in w["streams"].values())
        ),
        "busy_ranks": "",  # the busy ranks folded (``ranks 0-511,513-1023``): a short line
        "queued": sum(
            s["queued"] for w in ranks.values() if w["alive"] for s in w["streams"].values()
        ),
        "paused": len(sessions),
        "sessions": [
            {"rank": s["rank"], "stream": s["stream"], "label": session_label(s)} for s in sessions
        ],
        "errors": sum(len(g["ranks"]) for g in status["errors"]),
    }
    out["busy_ranks"] = format_ranks(out["busy"]) if out["busy"] else ""
    by_why: dict = {}
    for r, why in out["dead"].items():
        by_why.setdefault(why, []).append(int(r))
    out["dead_folded"] = {why: format_ranks(rs) for why, rs in by_why.items()}
    return out


def failed_streams(status: dict) -> set:
    """(rank, stream name) whose last command failed: no command after the newest
    failure finished there, except the one right behind it (a ``%%monarch`` cell is
    two commands: the code, then the fetch of its value)."""
    newest: dict = {}
    for e in status["errors"]:
        for r in e["ranks"]:
            key = (r, e["stream"])
            newest[key] = max(newest.get(key, -1), e["ident"])
    out = set()
    for (r, s), ident in newest.items():
        info = status["ranks"].get(r, {}).get("streams", {}).get(s)
        if info is not None and ident + 1 >= info.get("last", ident):
            out.add((r, s))
    return out


def cell_state(worker: dict, stream: dict, failed: bool) -> str:
    """idle, busy, paused (in the debugger), failed or dead: the colour of a queue cell."""
    if not worker["alive"]:
        return "dead"
    if stream.get("paused"):
        return "paused"
    if stream["running"] or stream["queued"]:
        return "busy"
    if failed:
        return "failed"
    return "idle"


def _secs(s: float | None) -> str:
    return "-" if s is None else f"{int(s)} s"


def _mb(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f} MB"


def _gb(n) -> str:
    return "-" if n is None else f"{n / 2**30:.1f} GB"


def heartbeat(worker: dict) -> tuple[str, bool]:
    """The heartbeat text and whether it is stale (red)."""
    age = worker.get("heartbeat_age")
    if not worker["alive"]:
        return "-", False
    if age is None:
        return "never", True
    if age < 2.0:
        return "<2 s", False
    if worker.get("unresponsive"):
        return f"unresponsive {int(age)} s", True
    return f"{int(age)} s", age >= HEARTBEAT_STALE


def header_html(status: dict, state: str) -> str:
    ranks = status["ranks"]
    alive = sum(1 for r in ranks.values() if r["alive"])
    dims = " ".join(f"{k}={v}" for k, v in status["dims"].items())
    parts = [
        f"<b>mesh {_esc(repr(status['name']))}</b>",
        _esc(dims),
        _esc(status["backend"]),
        f"generation {status.get('generation', 0)}",
        f"{alive}/{len(ranks)} workers alive",
    ]
    if state != "ok":
        note = {
            "shut down": "shut down",
            "broken": "broken: restart it",
            "restarting": "not running (restarting?)",
        }[state]
        parts.append(f"<span class='mnb-state' style='color:{RED};font-weight:bold'>{note}</span>")
    if status.get("bad_messages"):
        parts.append(f"<span style='color:{RED}'>{status['bad_messages']} bad messages</span>")
    paused = len(status.get("debugger", ()))
    if paused:
        parts.append(f"<span style='color:#306'>{paused} paused in the debugger</span>")
    return "<div class='mnb-head'>" + " · ".join(parts) + "</div>"


_TABLE = "border-collapse:collapse;margin:4px 0"
STYLE = (
    "<style>.mnb-status td,.mnb-status th,.mnb-dbg-list td,.mnb-dbg-list th"
    "{padding:2px 6px;border:1px solid #ddd;vertical-align:top;white-space:nowrap;"
    "text-align:left}</style>"
)


def _coords(status: dict, rank: int) -> str:
    """Row-major coordinates of a rank on the root mesh's dims."""
    sizes = list(status["dims"].values())
    out = []
    for size in reversed(sizes):
        out.append(rank % size)
        rank //= size
    return ",".join(str(c) for c in reversed(out))


def queues_html(status: dict) -> str:
    """Ranks x streams: queued, running (what, for how long), done; coloured by state."""
    ranks = status["ranks"]
    if not ranks:
        return "<div>no workers</div>"
    streams = list(next(iter(ranks.values()))["streams"])
    failed = failed_streams(status)
    dims = ",".join(status["dims"])
    head = f"<th>rank</th><th>{_esc(dims)}</th>" + "".join(f"<th>{_esc(s)}</th>" for s in streams)
    rows = []
    for r, w in ranks.items():
        cells = []
        for s in streams:
            info = w["streams"][s]
            state = cell_state(w, info, (r, s) in failed)
            bg, fg = COLORS[state]
            run = info["running"]
            lines = []
            if info.get("paused"):
                p = info["paused"]
                where = f"{p.get('file')}:{p.get('line')}"
                lines.append(f"paused at {_esc(where)}")
            elif run:
                what = str(run["what"])
                if len(what) > WHAT_CHARS:
                    what = what[: WHAT_CHARS - 1] + "…"
                lines.append(f"▶ {_esc(what)} · {_secs(run['elapsed'])}")
            else:
                lines.append("dead" if state == "dead" else state)
            stall = info.get("stalled")
            if stall and state != "dead":
                where = stall["stack"] or "(in the worker's own code)"
                lines.append(
                    f"<details class='mnb-stall'><summary>stalled {_secs(stall['for'])}: "
                    f"where</summary><pre style='text-align:left;white-space:pre-wrap'>"
                    f"{_esc(where)}</pre></details>"
                )
            lines.append(
                f"<span class='mnb-q'>{info['queued']} queued</span> · "
                f"<span class='mnb-done'>{info['done']} done</span>"
            )
            cells.append(
                f"<td class='mnb-cell mnb-{state}' data-rank='{r}' data-stream='{_esc(s)}' "
                f"style='background:{bg};color:{fg}'>{'<br>'.join(lines)}</td>"
            )
        rows.append(f"<tr><td>{r}</td><td>{_coords(status, r)}</td>{''.join(cells)}</tr>")
    return f"<table class='mnb-queues' style='{_TABLE}'><tr>{head}</tr>{''.join(rows)}</table>"


def health_html(status: dict) -> str:
    """Per worker: pid, host, alive or how it exited, RSS, CPU, GPU, heartbeat age."""
    ranks = status["ranks"]
    gpu = any(w.get("gpu") for w in ranks.values())
    cols = ["rank", "pid", "host", "state", "RSS", "CPU"] + (["GPU mem", "GPU util"] if gpu else [])
    alloc = any("allocated" in (w.get("gpu") or {}) for w in ranks.values())
    cols += ["allocated / reserved (peak)"] if alloc else []
    cols.append("heartbeat")
    head = "".join(f"<th>{c}</th>" for c in cols)
    rows = []
    for r, w in ranks.items():
        if w["alive"]:
            state = "alive"
        else:  # a clean exit (shut down) in grey, anything else in red
            color = "#777" if w.get("exit_code") == 0 else RED
            state = (
                f"<span style='color:{color}'>{_esc(str(w.get('exit') or 'not started'))}</span>"
            )
        cpu = "-" if w.get("cpu") is None else f"{w['cpu']:.0f}%"
        cells = [str(r), str(w.get("pid") or "-"), _esc(str(w.get("host") or "-")), state]
        cells += [_mb(w.get("rss")), cpu]
        if gpu:
            g = w.get("gpu") or {}
            util = g.get("util")
            cells += [_gb(g.get("mem")), "-" if util is None else f"{util:.0f}%"]
            if alloc:  # the CUDA caching allocator's counters of the rank's first device
                cells.append(f"{_gb(g.get('allocated'))} / {_gb(g.get('reserved'))} ({_gb(g.get('peak'))})")
        beat, stale = heartbeat(w)
        cells.append(
            f"<span class='mnb-beat{' mnb-stale' if stale else ''}'"
            + (f" style='color:{RED};font-weight:bold'" if stale else "")
            + f">{_esc(beat)}</span>"
        )
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return f"<table class='mnb-health' style='{_TABLE}'><tr>{head}</tr>{''.join(rows)}</table>"


def main_html(status: dict, state: str = "ok") -> str:
    """Header, queues and health: the part of the dashboard redrawn most often."""
    return (
        "<div class='mnb-status' style='font-family:monospace;font-size:12px'>"
        f"{STYLE}{header_html(status, state)}"
        f"<div style='display:flex;gap:12px;flex-wrap:wrap;align-items:flex-start'>"
        f"<div><b>queues</b>{queues_html(status)}</div>"
        f"<div><b>workers</b>{health_html(status)}</div></div></div>"
    )


def group_errors(errors: list) -> list[dict]:
    """Failures grouped by distinct (type, message, traceback), newest first: each
    with its ranks, streams, the number of failures and of commands."""
    out = []
    items = ((e["type"], e["message"], e["traceback"], e) for e in errors)
    for (etype, message, tb), entries in group_by_traceback(items):
        out.append(
            {
                "type": etype,
                "message": message,
                "traceback": tb,
                "ranks": sorted({r for e in entries for r in e["ranks"]}),
                "streams": sorted({e["stream"] for e in entries}),
                "count": sum(len(e["ranks"]) for e in entries),
                "commands": len(entries),
                "time": max(e.get("time", 0.0) for e in entries),
            }
        )
    return sorted(out, key=lambda g: -g["time"])


def errors_html(status: dict) -> str:
    """The failures, one expandable line per distinct traceback, newest first."""
    groups = group_errors(status["errors"])
    if not groups:
        return "<div class='mnb-errors' style='font-family:monospace;font-size:12px'></div>"
    items = []
    for g in groups[:MAX_ERROR_GROUPS]:
        when = time.strftime("%H:%M:%S", time.localtime(g["time"])) if g["time"] else ""
        n = g["count"]
        counts = f"{n} failure{'s' if n != 1 else ''}"
        if g["commands"] > 1:
            counts += f" in {g['commands']} commands"
        streams = ", ".join(g["streams"])
        tb = g["traceback"] or ""
        if len(tb) > MAX_TRACEBACK:
            tb = "…" + tb[-MAX_TRACEBACK:]
        items.append(
            "<details class='mnb-error'><summary>"
            f"<b style='color:{RED}'>{_esc(g['type'])}</b>"
            + (f": {_esc(g['message'][:200])}" if g["message"] else "")
            + f" — <span class='mnb-ranks'>{format_ranks(g['ranks'])}</span> · {counts}"
            f" · stream {_esc(streams)} · {when}</summary>"
            f"<pre style='margin:2px 0 6px 16px;white-space:pre-wrap'>{_esc(tb)}</pre></details>"
        )
    more = len(groups) - MAX_ERROR_GROUPS
    if more > 0:
        items.append(f"<div>… {more} older distinct failures</div>")
    return (
        "<div class='mnb-errors' style='font-family:monospace;font-size:12px'>"
        f"<b>errors</b> ({len(groups)} distinct)" + "".join(items) + "</div>"
    )


def sessions_html(status: dict) -> str:
    """The paused debugger sessions: rank, stream, file:line, function."""
    sessions = status.get("debugger") or []
    if not sessions:
        return (
            "<div class='mnb-dbg-list' style='font-family:monospace;font-size:12px'>"
            "<b>debugger</b>: no paused sessions</div>"
        )
    rows = "".join(
        f"<tr><td>{s['rank']}</td><td>{_esc(str(s['stream']))}</td>"
        f"<td>{_esc(str(s.get('file')))}:{s.get('line')}</td>"
        f"<td>{_esc(str(s.get('function')))}</td></tr>"
        for s in sessions
    )
    head = "".join(f"<th>{c}</th>" for c in ("rank", "stream", "where", "function"))
    return (
        f"<div class='mnb-dbg-list' style='font-family:monospace;font-size:12px'>{STYLE}"
        f"<b>debugger</b>: {len(sessions)} paused session{'s' if len(sessions) != 1 else ''}"
        f"<table style='{_TABLE}'><tr>{head}</tr>{rows}</table></div>"
    )


def session_label(s: dict) -> str:
    return f"rank {s['rank']} · {s['stream']} · {s.get('file')}:{s.get('line')} {s.get('function')}"


def output_html(text: str) -> str:
    return (
        "<pre class='mnb-dbg-log' style='font-size:12px;max-height:240px;overflow:auto;"
        f"margin:2px 0;white-space:pre-wrap'>{_esc(text)}</pre>"
        if text
        else ""
    )
