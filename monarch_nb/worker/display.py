"""Worker side of ``%%monarch``: run a cell, then hand its value and figures home.

``run_cell`` runs on a stream (the ``RunCell`` command, ``mesh.run_cell``): it
binds the names pushed from the notebook, executes the cell in the persistent
namespace as IPython would (``ipython_shell``: magics, ``!cmd``, ``obj?``), and
keeps what the notebook will show (what the cell ``display()``ed, a mimebundle of
the last expression's value, the matplotlib figures the cell drew) under the
command's key until ``take_result``, which the same command's reply runs right
behind it on the stream. A failing cell still reports through the normal failure
path (RemoteFunctionFailed) first; the reply then carries only its displays and
figures.

IPython is imported by the first cell (``ipython_shell``), never by this module;
matplotlib is touched only when user code has imported it already.
"""

from __future__ import annotations

import base64
import json
import pprint
import sys
import threading

from . import breakpoints, context

MAX_TEXT = 200_000  # characters of one text repr kept; the rest is dropped with a notice
MAX_FIGURES = 20  # figures sent per cell and rank
MAX_DISPLAYS = 100  # display() bundles sent per cell and rank; later ones are dropped

_results: dict = {}  # key -> {"data": bundle or None, "figures": [...], "displays": [...]}
_auto: dict = {}  # name -> the object last bound automatically under that name
# while a cell runs on this thread: .figures, .displays (bundles in order) and
# .display_ids (transient display_id -> index in .displays)
_collecting = threading.local()
_ipython = None  # the ipython_shell module once a cell loaded it; False: no IPython here

_MIME_METHODS = (
    ("_repr_html_", "text/html"),
    ("_repr_markdown_", "text/markdown"),
    ("_repr_svg_", "image/svg+xml"),
    ("_repr_png_", "image/png"),
    ("_repr_jpeg_", "image/jpeg"),
    ("_repr_latex_", "text/latex"),
    ("_repr_json_", "application/json"),
)


def run_cell(
    source: str, filename: str, key: int, names: dict | None = None, auto: dict | None = None
) -> None:
    """Execute a ``%%monarch`` cell in the worker's namespace (see module doc).

    ``names`` are bound first; ``auto`` (notebook functions and classes the cell
    reads) too, except over a worker variable that worker code defined."""
    ns = context.namespace
    figures: list = []
    displays: list = []
    _collecting.figures, _collecting.displays, _collecting.display_ids = figures, displays, {}
    value = None
    try:
        for name, obj in (auto or {}).items():
            if name not in ns or ns[name] is _auto.get(name, _auto):
                ns[name] = _auto[name] = obj
        if names:
            ns.update(names)
        value = _run(source, filename, ns)
    finally:
        _collecting.figures = _collecting.displays = _collecting.display_ids = None
        figures.extend(_take_open_figures(skip=_figure_of(value)))
        _results[key] = {"data": None, "figures": figures[:MAX_FIGURES], "displays": displays}
    _results[key]["data"] = mimebundle(value) if value is not None else None


def _run(source: str, filename: str, ns: dict):
    """The cell, as an IPython cell of the worker's shell (plain Python without IPython)."""
    sh = _shell(ns)
    if sh is None:
        return breakpoints.run_source(source, filename, ns)
    info = _ipython.before_cell(sh, source)
    value = error = None
    try:
        value = breakpoints.run_source(source, filename, ns, _ipython.to_python)
        return value
    except BaseException as e:
        error = e
        raise
    finally:
        _ipython.after_cell(sh, info, value, error)


def _shell(ns: dict):
    """The worker's IPython shell, made by the first cell (None where IPython is missing)."""
    if _ipython is None:
        preload()
    return _ipython.shell(ns) if _ipython else None


def preload() -> None:
    """Import IPython's shell now, not at the first cell (the host agent does, before
    it forks: each rank's first cell is then ~50 ms sooner)."""
    global _ipython
    try:
        from . import ipython_shell
    except ImportError:  # the cells of this worker are plain Python
        _ipython = False
    else:
        _ipython = ipython_shell


def publish(data: dict, metadata=None, transient=None, update: bool = False) -> None:
    """``display()`` of a bundle: shown with the running cell's results (``update``:
    in place of the one shown under the same ``transient`` display_id). Outside a
    cell (a thread it started, a remote function) its ``text/plain`` is printed."""
    displays = getattr(_collecting, "displays", None)
    if displays is None:
        text = data.get("text/plain")
        if text is not None:
            print(text)
        return
    bundle = _checked({k: _jsonable(k, v) for k, v in data.items() if v is not None})
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


def clear_output() -> None:
    """``clear_output()`` in a cell: what it ``display()``ed so far is not shown."""
    displays = getattr(_collecting, "displays", None)
    if displays is not None:
        displays.clear()
        _collecting.display_ids.clear()


def take_result(key: int) -> dict | None:
    """What ``run_cell(key)`` left for the notebook (None if it never ran here)."""
    return _results.pop(key, None)


def discard(key: int) -> None:
    _results.pop(key, None)


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
    """A bundle that travels: JSON that serialises, texts cut at MAX_TEXT."""
    if "application/json" in data:
        try:
            json.dumps(data["application/json"])
        except (TypeError, ValueError):
            del data["application/json"]
    for k, v in list(data.items()):
        if isinstance(v, str) and k.startswith("text/") and len(v) > MAX_TEXT:
            dropped = len(v) - MAX_TEXT
            data[k] = v[:MAX_TEXT] + f"\n[... {dropped} bytes of output dropped ...]"
    return data


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


def _figure_of(value):
    figure_mod = sys.modules.get("matplotlib.figure")
    if figure_mod is not None and isinstance(value, figure_mod.Figure):
        return value
    return None


def _png_of_figure(obj) -> str | None:
    fig = _figure_of(obj)
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


def _take_open_figures(skip=None) -> list:
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
    figures.extend(_take_open_figures())
