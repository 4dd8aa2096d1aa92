"""torch's default dtype on the ranks: the controller's.

``torch.set_default_dtype(torch.float64)`` in the notebook changes what a factory, or
a promotion of integers with Python floats, makes here, where FakeTensor plans each
op's result; the ranks (processes of their own) kept float32. The controller and the
ranks then disagreed on dtypes without a word. Now the plans made under another
default are dropped (``plans.lookup``), and before an op reaches a group of ranks whose
default differs from this process's, that default is set on them, in stream order.
"""

from __future__ import annotations

import weakref

import torch

from ...protocol.wire import function_ref
from .send import aux_template, run

_get = torch.get_default_dtype
_FRESH = torch.float32  # a new worker's
_SET = function_ref(torch.set_default_dtype)
_changed = [False]  # whether this process's default was ever another than float32
# ctrl -> (its generation, {targets: the default its ranks hold})
_told: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def follow(ctrl, mesh, stream) -> None:
    """Before an op is sent to ``mesh``'s ranks: their default dtype is this process's."""
    dtype = _get()
    if dtype is _FRESH and not _changed[0]:
        return
    _changed[0] = True
    gen = ctrl.generation
    state = _told.get(ctrl)
    if state is None or state[0] != gen:
        state = _told[ctrl] = (gen, {})
    held = state[1].get(mesh.targets, _FRESH)
    if held is dtype:
        return
    template = aux_template(("default_dtype", dtype), (dtype,), _SET, "set_default_dtype")
    result, _ = run(ctrl, template, (), {}, (), mesh, stream, "set_default_dtype")
    ctrl.delete_ref(result)
    told = state[1]
    for targets, held in list(told.items()):  # a group sharing ranks with these: mixed
        if held is not dtype and set(targets) & set(mesh.targets):
            del told[targets]
    told[mesh.targets] = dtype
