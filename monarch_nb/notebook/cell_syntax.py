"""The kernel's syntax check of a ``%%monarch`` cell, before anything is sent: a
SyntaxError is shown once, here, not once per rank.

A cell is an IPython cell on the workers (``worker/ipython_shell.py``): it passes
when it compiles as Python, or as the Python that IPython's input transformers
make of it, with its leading comment and blank lines (the ``# %%monarch`` header
line among them) kept apart as the workers keep them, so that line numbers match
and a cell magic may follow the header.
"""

from __future__ import annotations

import functools

from IPython.core.inputtransformer2 import TransformerManager

from .results import CellSyntaxError


@functools.cache
def _transformer() -> TransformerManager:
    return TransformerManager()


def check(source: str, filename: str, shell) -> None:
    """Raise CellSyntaxError (rendered by ``shell``'s SyntaxTB) unless ``source`` compiles."""
    try:
        compile(source, filename, "exec")
        return
    except SyntaxError:
        pass
    lines = source.splitlines(keepends=True)
    n = 0
    while n < len(lines) and (not lines[n].strip() or lines[n].lstrip().startswith("#")):
        n += 1
    head = "".join(lines[:n])
    if head and not head.endswith("\n"):
        head += "\n"
    try:
        compile(head + _transformer().transform_cell("".join(lines[n:])), filename, "exec")
    except SyntaxError as e:
        shown = shell.SyntaxTB.structured_traceback(type(e), e, [])
        raise CellSyntaxError(e, shown) from None
