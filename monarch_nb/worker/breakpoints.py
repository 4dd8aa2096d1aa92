"""Breakpoints set in JupyterLab's gutter, run on the worker by a RemotePdb.

The kernel (notebook/dap_breakpoints.py) sends the whole table as a
DebuggerMessage action ``("breakpoints", table)`` (protocol/breakpoints.py
says its shape). A command touching one of its cells or files
runs under a RemotePdb that only stops at a breakpoint; without breakpoints
nothing changes on the way a command runs.
"""

from __future__ import annotations

import linecache
import sys

from ..protocol.breakpoints import cell_key
from . import code, remote_pdb

_table: dict = {"cells": {}, "files": {}}


def update(table: dict) -> None:
    """Replace the table (the receiver thread; a command reads it when it starts)."""
    global _table
    _table = {"cells": dict(table.get("cells", {})), "files": dict(table.get("files", {}))}


def deliver(stream, action) -> None:
    """A DebuggerMessage's action (the receiver thread): the breakpoint table, a
    pause of the stream's running session, or a line for its paused pdb."""
    if isinstance(action, tuple) and action and action[0] == "breakpoints":
        update(action[1])
    elif isinstance(action, tuple) and action and action[0] == "pause":
        remote_pdb.pause(stream)
    else:
        stream.debugger_queue.put(action)


def run_source(source: str, filename: str, namespace: dict, to_python=None):
    """``code.run_source``, under the breakpoints of this cell and of notebook files."""
    table = _table
    if not table["cells"] and not table["files"]:  # the hot path: no breakpoint anywhere
        return code.run_source(source, filename, namespace, to_python)
    lines = table["cells"].get(cell_key(source.partition("\n")[2]))
    if not lines and not table["files"]:
        return code.run_source(source, filename, namespace, to_python)
    code.register_source(filename, source)
    breaks = [(filename, line, cond) for line, cond in lines or ()]
    work = lambda: code.run_source(source, filename, namespace, to_python)  # noqa: E731
    return _traced(work, breaks, table)


def call(fn, args, kwargs):
    """``fn(*args, **kwargs)``, under the breakpoints of fn's notebook file, if any."""
    table = _table
    if not table["files"]:  # the hot path
        return fn(*args, **kwargs)
    file = getattr(getattr(fn, "__code__", None), "co_filename", None)
    if file not in table["files"]:
        return fn(*args, **kwargs)
    return _traced(lambda: fn(*args, **kwargs), [], table)


def _traced(work, breaks: list, table: dict):
    stream = remote_pdb.current_stream()
    if stream is None or sys.gettrace() is not None:  # a session traces already: it wins
        return work()
    for path, (source, lines) in table["files"].items():
        if path not in linecache.cache and source is not None:
            code.register_source(path, source)  # the file may be on the kernel's host only
        breaks += [(path, line, cond) for line, cond in lines]
    p = remote_pdb.RemotePdb(stream)
    p.reset()
    mine = []
    for path, line, cond in breaks:
        if p.set_break(path, line, cond=cond or None) is None:  # else: why not (no such line)
            mine.append(p.get_breaks(path, line)[-1])
    # stop at breakpoints only: a stop frame that never runs, and no line to stop at
    p._set_stopinfo(sys._getframe(), None, -1)
    sys.settrace(p.trace_dispatch)
    try:
        return work()
    finally:
        sys.settrace(None)
        for bp in mine:  # bdb keeps breakpoints class-wide: only ours go
            bp.deleteMe()
        p.end()


__all__ = ["call", "cell_key", "deliver", "run_source", "update"]
