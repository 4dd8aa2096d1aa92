"""Functions of the worker's own that the controller side sends, named by path.

A ``%%monarch`` cell is a CallFunction of ``run_cell`` and a SendValue of
``take_result`` (``worker/display.py``). The kernel never imports worker code for
them: each ``Function`` here is the pickle of a reference (module and name), which
the worker resolves by importing the module, as it does for any importable
function (the reference Monarch names worker functions by path alike).
``tests/test_layers.py`` checks that every name here resolves.
"""

from __future__ import annotations

import pickle

from .messages import Function

CELL_MODULE = "monarch_nb.worker.display"


def _short(text: str) -> bytes:
    raw = text.encode("utf-8")
    if len(raw) > 255:
        raise ValueError(f"name too long for a reference: {text!r}")
    return pickle.SHORT_BINUNICODE + bytes([len(raw)]) + raw


def by_path(module: str, name: str) -> Function:
    """The ``Function`` that the worker loads as ``getattr(import_module(module), name)``."""
    for part in (module, name):
        if not all(p.isidentifier() for p in part.split(".")):
            raise ValueError(f"not a dotted name: {part!r}")
    payload = pickle.PROTO + bytes([4]) + _short(module) + _short(name) + pickle.STACK_GLOBAL
    return Function(payload + pickle.STOP, name)


RUN_CELL = by_path(CELL_MODULE, "run_cell")
TAKE_RESULT = by_path(CELL_MODULE, "take_result")
