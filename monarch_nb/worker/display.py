"""What a worker cell shows: its ``display()`` bundles (``publish``, ``clear_output``),
the mimebundle of a value (``mimebundle``) and the matplotlib figures it drew,
collected per cell on the thread that runs it (``cell_runner.py`` runs cells).

Never imports IPython; matplotlib is touched only when user code imported it already.
"""

from __future__ import annotations

import base64
import json
import pprint
import sys
import threading

from . import capture

MAX_TEXT = 200_000  # characters of one text repr kept; the rest is dropped with a notice
MAX_FIGURES = 20  # figures sent per cell and rank
MAX_DISPLAYS = 100  # display() bundles sent per cell and rank; later ones are dropped
MAX_BUNDLE = 8 << 20  # bytes one shown bundle may carry (images base64); past it, a notice

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
# fn(bundle, metadata) that shows a widget's view at once (widget_comm sets it), or None
show_widget = None

# while a cell runs on this thread: .figures, .displays (bundles in order) and
# .display_ids (transient display_id -> index in .displays)
_collecting = threading.local()

_MIME_METHODS = (
    ("_repr_html_", "text/html"),
    ("_repr_markdown_", "text/markdown"),
    ("_repr_svg_", "image/svg+xml"),
    ("_repr_png_", "image/png"),
    ("_repr_jpeg_", "image/jpeg"),
    ("_repr_latex_", "text/latex"),
    ("_repr_json_", "application/json"),
)


def begin_collecting(figures: list, displays: list) -> None:
    """A cell starts on this thread: what it ``display()``s and draws goes to these."""
    _collecting.figures, _collecting.displays, _collecting.display_ids = figures, displays, {}


def end_collecting() -> None:
    _collecting.figures = _collecting.displays = _collecting.display_ids = None


def publish(data: dict, metadata=None, transient=None, update: bool = False) -> None:
    """``display()`` of a bundle: shown with the running cell's results (``update``:
    in place of the one shown under the same ``transient`` display_id); a widget's
    view at once (``show_widget``). Outside a cell (a thread it started, a remote
    function) its ``text/plain`` is printed."""
    displays = getattr(_collecting, "displays", None)
    if displays is None:
        text = data.get("text/plain")
        if text is not None:
            print(text)
        return
    bundle = _checked({k: _jsonable(k, v) for k, v in data.items() if v is not None})
    if WIDGET_VIEW in bundle and show_widget is not None and not update:
        show_widget(bundle, metadata)  # live at once, as its comm is (a progress bar)
        return
    display_id = (transient or {}).get("display_id")
    ids = _collecting.display_ids
    if update:
        if display_id in ids:
            displays[ids[display_id]] = bundle
        return
    if len(displays) < MAX_DISPLAYS:
        if display_id is not None:
            ids[display_id] = len(displays)
        displays.append(bundle)


def clear_output(wait: bool = False) -> None:
    """``clear_output()`` in a cell: what it ``display()``ed so far is not shown, and
    what this rank printed so far leaves the cell (with ``wait``: when it next prints)."""
    capture.mark_clear(wait)
    displays = getattr(_collecting, "displays", None)
    if displays is not None:
        displays.clear()
        _collecting.display_ids.clear()


# ---------------------------------------------------------------- mimebundles


def mimebundle(obj) -> dict:
    """The value as Jupyter shows it: ``text/plain`` and any rich reprs it has."""
    data: dict = {}
    fig_png = _png_of_figure(obj)
    if fig_png is not None:
        data["image/png"] = fig_png
    else:
        method = getattr(type(obj), "_repr_mimebundle_", None)
        if method is not None and not isinstance(obj, type):
            try:
                got = method(obj)
                if isinstance(got, tuple):
                    got = got[0]
                if isinstance(got, dict):
                    data.update({k: _jsonable(k, v) for k, v in got.items() if v is not None})
            except Exception:
                pass
        for attr, mime in _MIME_METHODS:
            if mime in data:
                continue
            method = getattr(type(obj), attr, None)
            if method is None or isinstance(obj, type):
                continue
            try:
                v = method(obj)
            except Exception:
                continue
            if v is None:
                continue
            if isinstance(v, tuple):  # (data, metadata)
                v = v[0]
            data[mime] = _jsonable(mime, v)
    if "text/plain" not in data:
        data["text/plain"] = _plain(obj)
    return _checked(data)


def _checked(data: dict) -> dict:
    """A bundle that travels: JSON that serialises, texts cut at MAX_TEXT, and at
    most MAX_BUNDLE bytes in all (a bigger one becomes a notice saying so)."""
    sizes = {}
    if "application/json" in data:
        try:
            sizes["application/json"] = len(json.dumps(data["application/json"]))
        except (TypeError, ValueError):
            del data["application/json"]
    for k, v in list(data.items()):
        if isinstance(v, str) and k.startswith("text/") and len(v) > MAX_TEXT:
            dropped = len(v) - MAX_TEXT
            data[k] = v[:MAX_TEXT] + f"\n[... {dropped} bytes of output dropped ...]"
        if isinstance(v, str):
            sizes[k] = len(data[k])
    if sum(sizes.values()) <= MAX_BUNDLE:
        return data
    mime, size = max(sizes.items(), key=lambda kv: kv[1])
    return {
        "text/plain": f"[a display of {sum(sizes.values()):,} bytes was not shown: its {mime} "
        f"is {size:,} bytes, and a display may carry {MAX_BUNDLE:,} (save it to a file, "
        "or show a smaller image)]"
    }


def _jsonable(mime: str, v):
    if isinstance(v, bytes):
        if mime.startswith("image/") and mime != "image/svg+xml":
            return base64.b64encode(v).decode("ascii")
        return v.decode("utf-8", "replace")
    return v


def _plain(obj) -> str:
    try:
        if type(obj) in (dict, list, tuple, set, frozenset):
            return pprint.pformat(obj, width=100, sort_dicts=False)
        return repr(obj)
    except Exception as e:
        return f"<{type(obj).__name__} object (repr failed: {type(e).__name__}: {e})>"


# ---------------------------------------------------------------- matplotlib


def _pyplot():
    return sys.modules.get("matplotlib.pyplot")


def figure_of(value):
    figure_mod = sys.modules.get("matplotlib.figure")
    if figure_mod is not None and isinstance(value, figure_mod.Figure):
        return value
    return None


def _png_of_figure(obj) -> str | None:
    fig = figure_of(obj)
    if fig is None:
        return None
    return figure_png(fig)


def figure_png(fig) -> str | None:
    """The figure as a base64 PNG (None when it cannot be drawn)."""
    import io

    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", bbox_inches="tight")
    except Exception:
        return None
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _figure_entry(fig) -> dict | None:
    png = figure_png(fig)
    if png is None:
        return None
    w, h = fig.get_size_inches()
    return {"image/png": png, "text/plain": f"<Figure size {w * fig.dpi:g}x{h * fig.dpi:g}>"}


def take_open_figures(skip=None) -> list:
    """Render and close every open pyplot figure (as the inline backend does)."""
    plt = _pyplot()
    if plt is None:
        return []
    from matplotlib._pylab_helpers import Gcf

    out = []
    for manager in list(Gcf.get_all_fig_managers()):
        fig = manager.canvas.figure
        if fig is not skip and len(out) < MAX_FIGURES:
            entry = _figure_entry(fig)
            if entry is not None:
                out.append(entry)
        plt.close(fig)
    return out


def show_figures() -> None:
    """``plt.show()`` on a worker: inside a ``%%monarch`` cell, send the open
    figures with the cell's output (and close them); elsewhere, keep them open."""
    figures = getattr(_collecting, "figures", None)
    if figures is None:
        return
    figures.extend(take_open_figures())
