"""Gutter breakpoints of ``%%monarch`` cells and notebook files, for the workers.

JupyterLab names a cell by the file ``dumpCell`` wrote its text to. A
``setBreakpoints`` for a ``%%monarch`` cell's file is answered here (debugpy
never sees it: the kernel only runs the magic's call under that file name);
one for a plain cell goes to debugpy as before and is also kept, for the
functions of that cell that run remotely. The table goes to every running
mesh (a DebuggerMessage ``("breakpoints", table)``, worker/breakpoints.py) when
it changes and before a cell runs on a mesh that has not had it yet; with no
breakpoints ever set nothing is sent.
"""

from __future__ import annotations

import itertools
import os
import threading

from ..api import mesh as mesh_mod
from ..protocol.breakpoints import cell_key
from .dap_wire import off_loop, response, to_int

BP_BASE = 1 << 29  # our breakpoint ids, far above debugpy's
MAGIC = "%%monarch"


def read_cell(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except (OSError, UnicodeDecodeError):
        return None


def is_monarch_cell(text: str | None) -> bool:
    if not text:
        return False
    first = text.split("\n", 1)[0].strip()
    return first == MAGIC or first.startswith(MAGIC + " ")


def code_lines(text: str) -> tuple[set[int], str | None]:
    """The lines of a ``%%monarch`` cell that hold code (the magic's line is a
    comment on the worker), or why there are none (a SyntaxError)."""
    first, _, body = text.partition("\n")
    source = "# " + first + "\n" + body
    try:
        top = compile(source, "<cell>", "exec")
    except SyntaxError as e:
        return set(), f"the cell does not compile: {e.msg} (line {e.lineno})"
    lines, todo = set(), [top]
    while todo:
        co = todo.pop()
        lines.update(ln for _, _, ln in co.co_lines() if ln)
        todo.extend(c for c in co.co_consts if hasattr(c, "co_lines"))
    return lines, None


def _mesh_problem(first_line: str) -> str | None:
    """Why the cell's mesh cannot take breakpoints now (None: it can)."""
    from .args import cell_parser

    try:
        a = cell_parser().parse_line(first_line[len(MAGIC) :].strip())
        name = a.mesh
    except BaseException:  # noqa: B036 - a bad line is the cell's own error when it runs
        name = None
    meshes = mesh_mod.all_meshes()
    if name is None:
        try:
            mesh = mesh_mod.get_mesh()
        except RuntimeError:
            return "no mesh is running (it was shut down, or none was started)"
    else:
        mesh = meshes.get(name)
        if mesh is None:
            return f"no mesh named {name!r} is running (it was shut down, or not started)"
    if not mesh.alive:
        return f"mesh {mesh.name!r} was shut down"
    return None


class Breakpoints:
    """The breakpoints of ``%%monarch`` cells and notebook files, and their sending."""

    def __init__(self):
        self._lock = threading.Lock()
        self.cells: dict[str, tuple] = {}  # path -> (key, [(line, condition)])
        self.files: dict[str, tuple] = {}  # path -> (source, [(line, condition)])
        self.version = 0
        self._sent: dict[int, tuple] = {}  # mesh.key -> (generation, version)
        self._ids = itertools.count(BP_BASE + 1)

    def set_cell(self, path: str, text: str, wanted: list) -> dict:
        """The setBreakpoints body for a ``%%monarch`` cell's file."""
        first, _, body = text.partition("\n")
        lines, why_none = code_lines(text)
        problem = _mesh_problem(first)
        out, keep = [], []
        for bp in wanted:
            line = to_int(bp.get("line"))
            cond = bp.get("condition") or None
            reply = {"id": next(self._ids), "line": line, "source": {"path": path}}
            if why_none is not None:
                reply.update(verified=False, message=why_none)
            elif line == 1:
                reply.update(verified=False, message="line 1 is the %%monarch line: no code")
            elif line not in lines:
                reply.update(verified=False, message=f"no code on line {line} of this cell")
            elif bp.get("hitCondition") or bp.get("logMessage"):
                reply.update(
                    verified=False, message="hit counts and log points do not reach the workers"
                )
            else:
                keep.append((line, cond))
                if problem is not None:
                    reply.update(verified=False, message=f"not installed: {problem}")
                else:
                    reply.update(verified=True)
            out.append(reply)
        with self._lock:
            if keep:
                self.cells[path] = (cell_key(body), keep)
            else:
                self.cells.pop(path, None)
            self.version += 1
        self.send()
        return {"breakpoints": out}

    def set_file(self, path: str, wanted: list, reply: dict) -> None:
        """Keep what debugpy verified in a plain cell's file (its functions run remotely)."""
        got = (reply.get("body") or {}).get("breakpoints") or []
        conds = {to_int(b.get("line")): b.get("condition") or None for b in wanted}
        keep = [(b["line"], conds.get(b["line"])) for b in got if b.get("verified")]
        with self._lock:
            old = self.files.get(path)
            if keep:
                self.files[path] = (read_cell(path), keep)
            else:
                self.files.pop(path, None)
            if old != self.files.get(path):
                self.version += 1
        self.send()

    def clear(self) -> None:
        with self._lock:
            if self.cells or self.files:
                self.cells.clear()
                self.files.clear()
                self.version += 1
        self.send()

    def lines_of(self, path: str) -> list[dict]:
        """What ``debugInfo`` lists for ``path`` (JupyterLab restores its gutter from it)."""
        found = self.cells.get(path)
        return [{"line": ln} for ln, _ in found[1]] if found else []

    def table(self) -> dict:
        with self._lock:
            return {
                "cells": {key: list(lines) for key, lines in self.cells.values()},
                "files": {p: (src, list(lines)) for p, (src, lines) in self.files.items()},
            }

    def send(self) -> None:
        """Send the table to every running mesh that does not have this version of it."""
        if self.version == 0:  # the hot path: no breakpoint was ever set
            return
        table = None
        for mesh in list(mesh_mod.all_meshes().values()):
            stamp = (mesh.generation, self.version)
            if self._sent.get(mesh.key) == stamp or not mesh.alive:
                continue
            table = table if table is not None else self.table()
            try:
                mesh.debugger.set_breakpoints(table)
            except Exception:
                continue  # a mesh going away: the next cell tries again
            self._sent[mesh.key] = stamp

    def before_cell(self, *_info) -> None:
        """IPython's pre_run_cell: the table reaches new meshes before a cell runs."""
        try:
            self.send()
        except Exception:
            pass  # never in the way of the cell


async def set_breakpoints(adapter, message: dict, args: dict) -> dict:
    """A ``%%monarch`` cell's breakpoints are ours (debugpy would stop the kernel
    in the magic's call); a plain cell's go to debugpy and are kept for the workers."""
    path = (args.get("source") or {}).get("path") or ""
    wanted = args.get("breakpoints") or []
    text = read_cell(path) if path else None
    if is_monarch_cell(text):
        try:
            body = await off_loop(adapter.breakpoints.set_cell, path, text, wanted)
        except Exception as e:
            return response(message, error=f"setBreakpoints: {type(e).__name__}: {e}")
        adapter.debugger.breakpoint_list[path] = adapter.breakpoints.lines_of(path)
        return response(message, body)
    reply = await adapter.orig_request(message)
    if reply and reply.get("success") and is_notebook_file(path):
        try:
            adapter.breakpoints.set_file(path, wanted, reply)
        except Exception:
            pass  # the kernel's own breakpoints are set: the workers' are a bonus
    return reply


def is_notebook_file(path: str) -> bool:
    """A file ipykernel names a cell by (its temporary directory)."""
    try:
        from ipykernel.compiler import get_tmp_directory
    except ImportError:
        return False
    return os.path.dirname(os.path.abspath(path)) == os.path.abspath(get_tmp_directory())


__all__ = [
    "BP_BASE",
    "Breakpoints",
    "code_lines",
    "is_monarch_cell",
    "is_notebook_file",
    "set_breakpoints",
]
