"""A compact live status of a mesh (until the dashboard widget replaces it).

In a kernel it is an ``ipywidgets.HTML`` (class ``mnb-mesh-status``) whose
value the ticker thread re-renders from ``mesh.status()`` at most every
REFRESH seconds, and only when it changed; its display also carries the same
HTML and a plain-text line for front-ends without widgets. Each mesh has one
live view: showing the mesh again freezes the previous one.
"""

from __future__ import annotations

import html
import threading

REFRESH = 0.5  # seconds between re-renders of a live view (at most 2 updates/s)


def _mb(n) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MB"


def status_text(mesh) -> str:
    st = mesh.status()
    alive = sum(1 for r in st["ranks"].values() if r["alive"])
    dims = " ".join(f"{k}={v}" for k, v in st["dims"].items())
    state = "shut down" if not mesh.alive and alive == 0 else f"{alive}/{len(st['ranks'])} alive"
    pids = ", ".join(str(r["pid"]) for r in st["ranks"].values() if r["pid"])
    return f"mesh {st['name']!r}: {dims}, {st['backend']}, {state} (pids {pids or '-'})"


def status_html(mesh) -> str:
    st = mesh.status()
    dims = " ".join(f"{k}={v}" for k, v in st["dims"].items())
    ranks = st["ranks"]
    alive = sum(1 for r in ranks.values() if r["alive"])
    closed = not mesh.alive
    head = f"<b>{html.escape(st['name'])}</b> · {html.escape(dims)} · {st['backend']} · " + (
        "<span style='color:#c00'>shut down</span>"
        if closed and alive == 0
        else f"{alive}/{len(ranks)} workers alive"
        + ("" if not closed else " · <span style='color:#c00'>broken: restart it</span>")
    )
    streams = list(next(iter(ranks.values()))["streams"]) if ranks else []
    th = "".join(f"<th>{html.escape(s)}</th>" for s in streams)
    rows = []
    for r, w in ranks.items():
        coords = ",".join(str(c) for c in mesh.coords(r).values()) if r in mesh.ranks else ""
        if w["alive"]:
            state = f"pid {w['pid']}"
        else:
            state = f"<span style='color:#c00'>{html.escape(str(w['exit'] or 'down'))}</span>"
        cells = []
        for s in streams:
            info = w["streams"][s]
            run = info["running"]
            if info.get("paused"):
                now = "paused"
            elif run:
                now = f"{html.escape(str(run['what'])[:32])} ({run['elapsed']:.0f} s)"
            else:
                now = "idle"
            queued = f" +{info['queued']} queued" if info["queued"] else ""
            cells.append(f"<td>{now}{queued} · {info['done']} done</td>")
        cpu = "-" if w["cpu"] is None else f"{w['cpu']:.0f}%"
        rows.append(
            f"<tr><td>{r}</td><td>{coords}</td><td>{state}</td>{''.join(cells)}"
            f"<td>{_mb(w['rss'])}</td><td>{cpu}</td></tr>"
        )
    errors = st["errors"]
    err = ""
    if errors:
        e = errors[0]
        err = (
            f"<div style='color:#c00'>{len(errors)} failed command(s); last: "
            f"{html.escape(e['type'])} on ranks {e['ranks']}: {html.escape(e['message'][:80])}</div>"
        )
    return (
        "<div class='mnb-status' style='font-family:monospace;font-size:12px'>"
        f"<div>{head}</div>"
        "<table style='border-collapse:collapse'>"
        f"<tr><th>rank</th><th>coords</th><th>worker</th>{th}<th>rss</th><th>cpu</th></tr>"
        f"{''.join(rows)}</table>{err}</div>"
    )


class StatusViews:
    """Live status views, one per mesh, refreshed from the ticker thread."""

    def __init__(self, ticker, in_kernel: bool):
        self.in_kernel = in_kernel
        self._views: dict[int, tuple] = {}  # id(controller) -> (mesh, widget, last html)
        self._lock = threading.Lock()
        self._render = threading.Lock()  # one re-render at a time
        self._last = 0.0
        self._ticker = ticker
        self._token = ticker.add(self._tick) if in_kernel else None

    def show(self, mesh) -> None:
        from IPython.display import display

        text = status_text(mesh)
        if not self.in_kernel:
            print(text)
            return
        body = status_html(mesh)
        import ipywidgets

        w = ipywidgets.HTML(value=body)
        w.add_class("mnb-mesh-status")
        with self._lock:
            self._views[id(mesh._controller)] = (mesh, w, body)
        display(
            {
                "text/plain": text,
                "text/html": body,
                "application/vnd.jupyter.widget-view+json": {
                    "version_major": 2,
                    "version_minor": 0,
                    "model_id": w.model_id,
                },
            },
            raw=True,
        )

    def refresh(self, mesh, final: bool = False) -> None:
        """Re-render the live view of ``mesh`` if it changed; ``final``: for the last time."""
        with self._render:
            with self._lock:
                v = self._views.get(id(mesh._controller))
                if v is None or v[0]._controller is not mesh._controller:
                    return
                if final:
                    del self._views[id(mesh._controller)]
            _, w, last = v
            body = status_html(mesh)
            if body != last:
                w.value = body
                if not final:
                    with self._lock:
                        self._views[id(mesh._controller)] = (mesh, w, body)

    def _tick(self, now: float) -> None:
        if now - self._last < REFRESH:
            return
        self._last = now
        with self._lock:
            views = list(self._views.values())
        for mesh, _, _ in views:
            # a mesh shut down for good gets its last update; a broken one keeps showing
            gone = not mesh.alive and not any(r["alive"] for r in mesh.status()["ranks"].values())
            self.refresh(mesh, final=gone)

    def close(self) -> None:
        if self._token is not None:
            self._ticker.remove(self._token)
