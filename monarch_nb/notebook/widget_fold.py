"""Progress bars of many ranks folded into one: a cell whose ranks ``display()``
progress widgets (``IntProgress``, ``FloatProgress``, tqdm.notebook's bar, a box
holding one) shows them per rank up to FOLD ranks; past that, their displays are
emptied and one aggregated bar stands for them all ("ranks 0-1023: 93 %": how far
all of them are together), a widget of this kernel redrawn each tick. Folded
widgets' updates are not sent to the frontend (none shows them): at a thousand
ranks that would be tens of thousands of messages a second.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from ..controller import format_ranks

FOLD = 8  # ranks of one cell whose progress bars are shown one per rank
CELLS = 64  # cells whose bars are still followed
PROGRESS = ("IntProgressModel", "FloatProgressModel")
_EMPTY = {"text/plain": ""}


class _Cell:
    """One cell's progress displays: shown per rank, or folded into ``box``."""

    def __init__(self, parent):
        self.parent = parent
        self.shown: dict[str, str] = {}  # model_id -> display_id, while shown per rank
        self.ranks: set[int] = set()
        self.bars: list[dict] = []  # the models of the folded bars
        self.box = self.bar = self.label = None  # the aggregate, once folded
        self.dirty = False


class Folds:
    """The rank widgets' states (from their comms) and each cell's progress displays."""

    def __init__(self, publisher):
        self.publisher = publisher
        self.models: dict[str, dict] = {}  # comm_id -> {"rank", "state"}
        self.cells: OrderedDict = OrderedDict()  # ident -> _Cell
        self.folded: dict[str, _Cell] = {}  # comm_id -> the cell whose aggregate has it
        self.lock = threading.Lock()

    def on_open(self, rank: int, comm_id: str, data: dict) -> None:
        with self.lock:
            self.models[comm_id] = {"rank": rank, "state": dict(data.get("state") or {})}

    def on_update(self, comm_id: str, data: dict) -> bool:
        """A rank's comm_msg; True: folded, so the frontend need not hear it."""
        with self.lock:
            model = self.models.get(comm_id)
            if model is not None and data.get("method") in ("update", "echo_update"):
                model["state"].update(data.get("state") or {})
            cell = self.folded.get(comm_id)
            if cell is None:
                return False
            cell.dirty = True
            return True

    def on_close(self, comm_id: str) -> None:
        with self.lock:
            self.models.pop(comm_id, None)  # a folded bar keeps counting as it ended
            self.folded.pop(comm_id, None)

    def show(self, parent, ident, rank: int, model_id: str, bundle: dict, metadata) -> bool:
        """``display()`` of a rank's widget; True: it was a progress bar, shown here."""
        with self.lock:
            bars = self._bars(model_id)
            if not bars:
                return False
            cell = self.cells.get(ident)
            if cell is None:
                cell = self.cells[ident] = _Cell(parent)
                while len(self.cells) > CELLS:
                    self.cells.popitem(last=False)
            cell.ranks.add(rank)
            if cell.box is None and len(cell.ranks) <= FOLD:
                display_id = f"mnb-widget-{model_id}"
                cell.shown[model_id] = display_id
                cell.bars.extend(bars)
                self.publisher.display(cell.parent, bundle, metadata, display_id)
                return True
            cell.bars.extend(bars)
            for mid in [model_id, *self._children(model_id)]:
                self.folded[mid] = cell
            if cell.box is None:
                self._fold(cell)
            cell.dirty = True
        return True

    def tick(self, now: float) -> None:
        """Redraw the aggregates whose bars moved (the ticker thread)."""
        with self.lock:
            for cell in list(self.cells.values()):
                if cell.dirty and cell.box is not None:
                    cell.dirty = False
                    self._draw(cell)

    def _bars(self, model_id: str) -> list[dict]:
        """The progress models shown by displaying ``model_id``: itself, or in it."""
        out = []
        for mid in [model_id, *self._children(model_id)]:
            model = self.models.get(mid)
            if model is not None and model["state"].get("_model_name") in PROGRESS:
                out.append(model)
        return out

    def _children(self, model_id: str) -> list[str]:
        model = self.models.get(model_id)
        kids = model["state"].get("children") if model is not None else None
        return [k[len("IPY_MODEL_") :] for k in kids or () if isinstance(k, str)]

    def _fold(self, cell: _Cell) -> None:
        """Empty the displays shown per rank; show the aggregate instead."""
        import ipywidgets as widgets

        for model_id, display_id in cell.shown.items():
            self.publisher.update_display(cell.parent, _EMPTY, display_id)
            for mid in [model_id, *self._children(model_id)]:
                self.folded[mid] = cell
        cell.shown.clear()
        cell.label = widgets.HTML()
        cell.bar = widgets.FloatProgress(min=0.0, max=1.0)
        cell.box = widgets.HBox([cell.label, cell.bar])
        self._draw(cell)
        self.publisher.display(cell.parent, cell.box._repr_mimebundle_())

    def _draw(self, cell: _Cell) -> None:
        done = total = 0.0
        styles = set()
        for model in cell.bars:
            s = model["state"]
            lo, hi, v = s.get("min") or 0, s.get("max") or 0, s.get("value") or 0
            if hi > lo:
                done += min(max(v - lo, 0), hi - lo)
                total += hi - lo
            styles.add(s.get("bar_style") or "")
        fraction = done / total if total else 0.0
        cell.bar.value = fraction
        cell.bar.bar_style = "danger" if "danger" in styles else (
            "success" if fraction >= 1.0 else ""
        )
        cell.label.value = f"{format_ranks(cell.ranks)}: {100 * fraction:.0f} %"
