"""The big-mesh controls of the dashboard: which stream the grid shows, and a
drill-down to one rank (its queues and health, the small mesh's table)::

    VBox  mnb-grid-controls     hidden on small meshes
      HBox  mnb-grid-row
        Dropdown  mnb-grid-stream   every stream (the worst state), one stream, or memory
        Text      mnb-grid-rank     a rank number; Enter shows it
      HTML  mnb-grid-detail     that rank's detail (redrawn with the dashboard)
"""

from __future__ import annotations

import html

import ipywidgets as W

from . import grid


def _classed(kind, cls: str, **kw):
    return kind(_dom_classes=(cls,), **kw)


class GridControls(W.VBox):
    """Stream choice and rank drill-down; ``on_change()`` runs after either changed."""

    def __init__(self, on_change=None):
        self._on_change = on_change
        self._streams: tuple = ()
        self._last: dict = {}
        self.rank: int | None = None
        self.stream_select = _classed(
            W.Dropdown,
            "mnb-grid-stream",
            options=[("every stream", grid.ALL), ("memory", grid.MEMORY)],
            value=grid.ALL,
            description="stream",
            layout=W.Layout(width="260px"),
        )
        self.rank_input = _classed(
            W.Text,
            "mnb-grid-rank",
            placeholder="rank number; Enter shows it",
            description="rank",
            continuous_update=False,
            layout=W.Layout(width="260px"),
        )
        self.detail = _classed(W.HTML, "mnb-grid-detail")
        row = _classed(W.HBox, "mnb-grid-row", children=[self.stream_select, self.rank_input])
        super().__init__(
            [row, self.detail],
            _dom_classes=("mnb-grid-controls",),
            layout=W.Layout(display="none"),
        )
        self.stream_select.observe(self._changed, "value")
        self.rank_input.observe(self._on_rank, "value")

    @property
    def stream(self) -> str:
        return self.stream_select.value or grid.ALL

    def show_rank(self, rank) -> None:
        """Drill down to ``rank`` (an int, or its text); None hides the detail."""
        self.rank_input.value = "" if rank is None else str(rank)

    def _on_rank(self, change) -> None:
        text = (change["new"] or "").strip()
        if not text:
            self.rank = None
        else:
            try:
                self.rank = int(text)
            except ValueError:
                self.rank = text  # drawn as "not a rank number"
        self._changed()

    def _changed(self, _change=None) -> None:
        if self._on_change is not None:
            self._on_change()

    def _set(self, widget, part: str, value) -> bool:
        if self._last.get(part) == value:
            return False
        self._last[part] = value
        widget.value = value
        return True

    def draw(self, status: dict, big: bool) -> bool:
        """Show (big meshes) or hide the controls; redraw the detail. True: it changed."""
        display = "flex" if big else "none"
        if self.layout.display != display:
            self.layout.display = display
        if not big:
            return False
        streams = tuple(grid.streams_of(status))
        if streams != self._streams:
            self._streams = streams
            keep = self.stream
            options = [("every stream", grid.ALL), ("memory", grid.MEMORY)]
            options += [(s, s) for s in streams]
            with self.stream_select.hold_sync():
                self.stream_select.options = options
                kept = keep in streams or keep == grid.MEMORY
                self.stream_select.value = keep if kept else grid.ALL
        return self._set(self.detail, "detail", self.detail_html(status))

    def detail_html(self, status: dict) -> str:
        if self.rank is None:
            return ""
        if not isinstance(self.rank, int):
            return (
                "<div class='mnb-rank-detail' style='font-family:monospace;font-size:12px'>"
                f"not a rank number: {html.escape(repr(self.rank))}</div>"
            )
        return grid.rank_detail_html(status, self.rank)

    def widgets(self) -> list:
        return [self.stream_select, self.rank_input, self.detail, self.children[0]]
