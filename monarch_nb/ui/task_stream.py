"""The dashboard's activity view: the task stream of every rank (``mesh.timeline()``),
its recent seconds as bars on rows of rank x stream, coloured by what ran (a cell, a
tensor op, a collective, a fetch, a call), stragglers outlined in red; and a button
that shows every rank's stacks (``mesh.stacks()``) for a stream that seems stuck.

``draw`` is called by the dashboard's redraw; it reads the timeline only while the
view is open, so a closed view costs nothing. ``task_stream_html`` is pure.
"""

from __future__ import annotations

import html
from concurrent.futures import ThreadPoolExecutor

import ipywidgets as W

from . import grid

COLOURS = {
    "cell": "#4e79a7",
    "op": "#59a14f",
    "collective": "#f28e2b",
    "fetch": "#b07aa1",
    "push": "#9c755f",
    "exec": "#76b7b2",
    "call": "#edc948",
    "running": "#bab0ac",  # a command still running: its bar grows to now
}
WINDOWS = {"2 s": 2.0, "10 s": 10.0, "1 min": 60.0, "10 min": 600.0}
WIDTH = 760  # px of the time axis
ROW = 14  # px per row
MAX_ROWS = 32  # past this many ranks, rows fold by host


def _fold(records: list, hosts: dict) -> tuple[list, dict]:
    """Row keys and labels: (rank, stream) rows, or, past MAX_ROWS ranks, (host,
    stream) rows by ``hosts`` (rank -> its host's row name, the grid's)."""
    ranks = {r["rank"] for r in records}
    if len(ranks) <= MAX_ROWS or not hosts:
        keys = sorted({(r["rank"], r["stream"]) for r in records})
        return keys, {k: f"rank {k[0]} {k[1]}" for k in keys}
    order = {h: i for i, h in enumerate(dict.fromkeys(hosts[r] for r in sorted(hosts)))}
    keys = sorted({(hosts.get(r["rank"], "-"), r["stream"]) for r in records},
                  key=lambda k: (order.get(k[0], len(order)), k[1]))  # fmt: skip
    return keys, {k: f"{k[0]} {k[1]}" for k in keys}


def task_stream_html(records: list, now: float, window: float, hosts: dict | None = None) -> str:
    """The last ``window`` seconds before ``now`` of ``records`` (``mesh.timeline()``'s
    dicts) as an SVG: a row per rank and stream (past 32 ranks, per host and stream:
    ``hosts`` maps a rank to its host, as the grid's rows do),
    a bar per command, neighbouring bars closer than a pixel merged."""
    start = now - window
    shown = [r for r in records if r["end"] >= start and r["start"] <= now]
    if not shown:
        return f'<div class="mnb-ts-empty">nothing ran in the last {window:g} s</div>'
    keys, labels = _fold(shown, hosts or {})
    folded = isinstance(keys[0][0], str)
    row_of = {k: i for i, k in enumerate(keys)}
    scale = WIDTH / window
    bars: dict = {}  # row -> [x0, x1, kind, straggler, title] in time order
    for r in sorted(shown, key=lambda r: r["start"]):
        key = (hosts.get(r["rank"], "-") if folded else r["rank"], r["stream"])
        x0 = max(0.0, (r["start"] - start) * scale)
        x1 = min(WIDTH, (r["end"] - start) * scale)
        row = bars.setdefault(row_of[key], [])
        last = row[-1] if row else None
        if last and last[2] == r["kind"] and x0 - last[1] < 1.0 and not r["straggler"]:
            last[1] = max(last[1], x1)
            continue
        took = (r["end"] - r["start"]) * 1e3
        title = f"rank {r['rank']} {r['stream']}: {r['name']} ({r['kind']}), {took:.1f} ms"
        row.append([x0, x1, r["kind"], r["straggler"], title])
    label_w = 150
    height = len(keys) * ROW + 18
    out = [
        f'<svg class="mnb-ts-svg" width="{label_w + WIDTH + 4}" height="{height}" '
        'xmlns="http://www.w3.org/2000/svg" font-family="monospace" font-size="10">'
    ]
    for key, i in row_of.items():
        y = i * ROW
        out.append(f'<text x="0" y="{y + 10}">{html.escape(labels[key])}</text>')
        out.append(
            f'<rect x="{label_w}" y="{y + 1}" width="{WIDTH}" height="{ROW - 2}" fill="#f4f4f4"/>'
        )
        for x0, x1, kind, straggler, title in bars.get(i, ()):
            stroke = ' stroke="#e15759" stroke-width="2" class="mnb-ts-straggler"' if straggler else ""
            out.append(
                f'<rect x="{label_w + x0:.1f}" y="{y + 1}" width="{max(1.0, x1 - x0):.1f}" '
                f'height="{ROW - 2}" fill="{COLOURS.get(kind, "#bab0ac")}"{stroke}>'
                f"<title>{html.escape(title)}</title></rect>"
            )
    y = len(keys) * ROW + 12
    out.append(f'<text x="{label_w}" y="{y}">-{window:g} s</text>')
    out.append(f'<text x="{label_w + WIDTH - 20}" y="{y}">now</text>')
    out.append("</svg>")
    legend = " ".join(
        f'<span style="color:{c}">&#9632;</span> {k}' for k, c in COLOURS.items()
    ) + ' <span style="color:#e15759">&#9633;</span> straggler (&gt; 1.5x its peers\' median)'
    return "".join(out) + f'<div class="mnb-ts-legend">{legend}</div>'


def running(status: dict | None, now: float) -> list:
    """What runs now on each rank's streams (``status()``), as records ending now."""
    out = []
    for rank, w in ((status or {}).get("ranks") or {}).items():
        for stream, info in (w.get("streams") or {}).items():
            run = info.get("running")
            if run:
                out.append({
                    "rank": rank, "stream": stream, "ident": run.get("ident"), "kind": "running",
                    "name": f"{run.get('what')} (running)", "start": now - run.get("elapsed", 0.0),
                    "end": now, "straggler": False,
                })  # fmt: skip
    return out


def stacks_html(stacks: dict) -> str:
    """``mesh.stacks()``'s answer: a block per rank and stream that runs something, a
    line per rank that did not answer."""
    parts = []
    for rank, streams in sorted(stacks.items()):
        if streams is None:
            parts.append(f"<div><b>rank {rank}</b>: no answer (stopped, or in native code)</div>")
            continue
        for stream, where in sorted(streams.items()):
            if not where.get("running"):
                continue
            head = html.escape(f"rank {rank} {stream}: {where['running']}")
            parts.append(f"<div><b>{head}</b><pre>{html.escape(where.get('stack') or '')}</pre></div>")
    return "".join(parts) or "<i>every stream is idle</i>"


class TaskStream(W.VBox):
    """The activity view of ``mesh`` (a part of its Dashboard): closed at first."""

    def __init__(self, mesh, now):
        self.mesh = mesh
        self._now = now  # the clock of the timeline's records (the controller's wall clock)
        self._last = None
        self._pool: ThreadPoolExecutor | None = None
        self.toggle = W.ToggleButton(
            description="activity", icon="bar-chart", _dom_classes=("mnb-ts-toggle",),
            tooltip="each rank's recent commands (mesh.timeline())",
        )  # fmt: skip
        self.zoom = W.ToggleButtons(
            options=list(WINDOWS), value="10 s", _dom_classes=("mnb-ts-zoom",),
            style={"button_width": "72px"},
        )  # fmt: skip
        self.b_stacks = W.Button(
            description="stacks", icon="list", _dom_classes=("mnb-ts-stacks",),
            tooltip="what every rank's streams run now (mesh.stacks())",
        )  # fmt: skip
        self.view = W.HTML(_dom_classes=("mnb-ts-view",))
        self.stacks = W.HTML(_dom_classes=("mnb-ts-stacks-out",))
        # the zoom is in the row only while the view is open (a narrow panel shows the rest)
        self.row = W.HBox([self.toggle, self.b_stacks], layout=W.Layout(flex_flow="row wrap"))
        super().__init__([self.row, self.view, self.stacks], _dom_classes=("mnb-ts",))
        self.toggle.observe(self._toggled, "value")
        self.zoom.observe(lambda _c: self.draw(), "value")
        self.b_stacks.on_click(self._click_stacks)

    def widgets(self) -> list:
        return [self.toggle, self.zoom, self.b_stacks, self.view, self.stacks, self.row]

    def _toggled(self, change) -> None:
        shown = [self.toggle, self.zoom, self.b_stacks] if change["new"] else [self.toggle, self.b_stacks]
        self.row.children = shown
        if not change["new"]:
            self._last = None
            self.view.value = ""
        self.draw()

    def draw(self, status: dict | None = None) -> bool:
        """Redraw while open (only what changed); True when the view changed.
        ``status`` (``mesh.status()``'s) adds what runs now, as bars up to now."""
        if not self.toggle.value:
            return False
        window = WINDOWS[self.zoom.value]
        try:
            # the window only, no round trip to the ranks: this runs 10 times a second
            records = self.mesh.timeline(since=self._now() - window, measure=False)
        except Exception as e:  # a mesh shut down or restarting: say so, keep the view
            text = f"<i>no timeline: {html.escape(str(e))}</i>"
        else:
            now = self._now()
            hosts = {r: h for h, rs in grid.host_rows(status) for r in rs} if status else None
            text = task_stream_html(records + running(status, now), now, window, hosts)
        if text == self._last:
            return False
        self._last = self.view.value = text
        return True

    def _click_stacks(self, _b=None) -> None:
        self.stacks.value = "<i>asking every rank…</i>"
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="monarch-nb-ui-stacks")
        self._pool.submit(self._show_stacks)

    def _show_stacks(self) -> None:
        try:
            self.stacks.value = stacks_html(self.mesh.stacks())
        except Exception as e:
            self.stacks.value = f"<i>stacks failed: {html.escape(str(e))}</i>"

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)
        super().close()
