"""torch's process-wide settings on the ranks: the controller's.

``torch.set_default_dtype(torch.float64)`` in the notebook changes what a factory, or
a promotion of integers with Python floats, makes here, where FakeTensor plans each
op's result; ``torch.use_deterministic_algorithms(True)``,
``torch.set_float32_matmul_precision("high")`` (TF32 on a GPU) or
``torch.backends.cudnn.benchmark = True`` change what, or how fast, the ranks compute.
The ranks are processes of their own: they kept torch's defaults, and the controller
and the ranks disagreed without a word. Now, before an op reaches a group of ranks
whose settings differ from this process's (``protocol.torch_settings``), the ones that
differ are set on them, in stream order; plans made under another default dtype are
dropped (``plans.lookup``).
"""

from __future__ import annotations

import warnings
import weakref

from ...protocol import torch_settings
from ...protocol.wire import function_ref
from .send import aux_template, run

_read = torch_settings.read
_FRESH = torch_settings.FRESH
_APPLY = function_ref(torch_settings.apply)
_changed = [False]  # whether this process's settings were ever another than torch's defaults
_warned = [False]  # the fp32_precision API's warning, once a process
# ctrl -> (its generation, {targets: the settings its ranks hold})
_told: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def follow(ctrl, mesh, stream) -> None:
    """Before an op is sent to ``mesh``'s ranks: their settings are this process's."""
    now = _read()
    if not _changed[0]:
        if now == _FRESH:
            return
        _changed[0] = True
    gen = ctrl.generation
    state = _told.get(ctrl)
    if state is None or state[0] != gen:
        state = _told[ctrl] = (gen, {})
    told = state[1]
    held = told.get(mesh.targets, _FRESH)
    if now[-1] is None:  # the fp32_precision API was used: those fields stay as held
        now = now[:-2] + held[-2:]
        if not _warned[0]:
            _warned[0] = True
            warnings.warn(
                "torch's fp32_precision settings (torch.backends.*.fp32_precision) are "
                "not carried to the mesh's ranks: set them in a %%monarch cell, or use "
                "torch.set_float32_matmul_precision and torch.backends.cudnn.allow_tf32, "
                "which are",
                stacklevel=3,
            )
    if held == now:
        return
    changes = torch_settings.changes_from(held, now)
    template = aux_template(("torch_settings", changes), (changes,), _APPLY, "torch settings")
    result, _ = run(ctrl, template, (), {}, (), mesh, stream, "torch settings")
    ctrl.delete_ref(result)
    for targets, other in list(told.items()):  # a group sharing ranks with these: mixed
        if other != now and set(targets) & set(mesh.targets):
            del told[targets]
    told[mesh.targets] = now
