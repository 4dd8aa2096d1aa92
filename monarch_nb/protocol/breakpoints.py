"""The breakpoint table the kernel sends workers (a DebuggerMessage action
``("breakpoints", table)``): ``table["cells"]`` maps ``cell_key`` of a
``%%monarch`` cell's body (its lines after the magic's line) to
``[(line, condition)]``; ``table["files"]`` maps a notebook file (a plain cell,
whose functions run remotely) to ``(source, [(line, condition)])``."""

from __future__ import annotations

import hashlib


def cell_key(body: str) -> str:
    """The key of a ``%%monarch`` cell's body: the kernel computes it from the text
    JupyterLab dumped, the worker from the source it runs (trailing blanks aside)."""
    lines = [ln.rstrip() for ln in body.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return hashlib.sha1("\n".join(lines).encode("utf-8")).hexdigest()


__all__ = ["cell_key"]
