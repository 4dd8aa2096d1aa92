"""Worker side of ``%%monarch``: run a cell, then hand its value and figures home.

``run_cell`` runs on a stream (the ``RunCell`` command, ``mesh.run_cell``): it
binds the names pushed from the notebook, executes the cell in the persistent
namespace as IPython would (``ipython_shell``: magics, ``!cmd``, ``obj?``), and
keeps what the notebook will show (what the cell ``display()``ed, a mimebundle of
the last expression's value, the matplotlib figures the cell drew: ``display.py``)
under the command's key until ``take_result``, which the same command's reply runs
right behind it on the stream. A failing cell still reports through the normal
failure path (RemoteFunctionFailed) first; the reply then carries only its displays
and figures.

IPython is imported by the first cell (``ipython_shell``), or before the fork by the
host agent (``preload``), never by this module at import.
"""

from __future__ import annotations

from . import autoreload, breakpoints, current, display

_results: dict = {}  # key -> {"data": bundle or None, "figures": [...], "displays": [...]}
_auto: dict = {}  # name -> the object last bound automatically under that name
_ipython = None  # the ipython_shell module once a cell loaded it; False: no IPython here


def run_cell(
    source: str, filename: str, key: int, names: dict | None = None, auto: dict | None = None
) -> None:
    """Execute a ``%%monarch`` cell in the worker's namespace (see module doc).

    ``names`` are bound first; ``auto`` (notebook functions and classes the cell
    reads) too, except over a worker variable that worker code defined."""
    ns = current.namespace
    figures: list = []
    displays: list = []
    display.begin_collecting(figures, displays)
    value = None
    try:
        for name, obj in (auto or {}).items():
            if name not in ns or ns[name] is _auto.get(name, _auto):
                ns[name] = _auto[name] = obj
        if names:
            ns.update(names)
        value = _run(source, filename, ns)
    finally:
        display.end_collecting()
        figures.extend(display.take_open_figures(skip=display.figure_of(value)))
        _results[key] = {
            "data": None,
            "figures": figures[: display.MAX_FIGURES],
            "displays": displays,
        }
    _results[key]["data"] = display.mimebundle(value) if value is not None else None


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
        autoreload.follow(sh)  # %autoreload 2 in a cell: every later command reloads too


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


def take_result(key: int) -> dict | None:
    """What ``run_cell(key)`` left for the notebook (None if it never ran here)."""
    return _results.pop(key, None)
