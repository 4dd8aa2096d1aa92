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

The ranks' random generators, seeded per process by torch, drew different numbers:
a model made under the mesh without ``torch.manual_seed`` started as another model
on each rank (data-parallel replicas apart from the first step). As DTensor's RNG
tracker takes rank 0's seed at its first random op, the ranks a first op reaches
are seeded with one seed, this process's ``torch.initial_seed()`` (so a seed set
here before the mesh starts makes a run repeat); ``torch.manual_seed`` under the
mesh marks its ranks seeded (``seeded_by_user``).
"""

from __future__ import annotations

import warnings
import weakref

import torch

from ...protocol import aten, torch_settings
from ...protocol.wire import function_ref
from ..context import recording_trace
from .send import aux_template, define, run

_read = torch_settings.read
_FRESH = torch_settings.FRESH
_APPLY = function_ref(torch_settings.apply)
_changed = [False]  # whether this process's settings were ever another than torch's defaults
_warned = [False]  # the fp32_precision API's warning, once a process
# ctrl -> (its generation, {targets: the settings its ranks hold})
_told: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SEED = function_ref(aten.manual_seed)
# ctrl -> (its generation, {the ranks seeded}, the seed); _seen: the last op's
# controller (weakly), generation and targets, whose ranks are seeded
_seeded: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_seen: list = [lambda: None, -1, None]


def seeded_by_user(ctrl, mesh) -> None:
    """``torch.manual_seed`` under ``mesh``: its ranks keep the user's seed."""
    _seed_state(ctrl)[1].update(mesh.targets)


def _seed_state(ctrl) -> tuple:
    state = _seeded.get(ctrl)
    if state is None or state[0] != ctrl.generation:
        state = _seeded[ctrl] = (ctrl.generation, set(), torch.initial_seed())
    return state


def _seed_new_ranks(ctrl, mesh, stream) -> None:
    """Before the first op that reaches ranks of this generation: those ranks get
    the one seed (on the op's stream, so the op draws from it)."""
    if recording_trace.active is not None:  # a compiled call would seed on every replay
        return
    state = _seed_state(ctrl)
    _seen[:] = [weakref.ref(ctrl), ctrl.generation, mesh.targets]
    new = tuple(r for r in mesh.targets if r not in state[1])
    if not new:
        return
    state[1].update(new)
    # a tensor op (RunOps), as the op after it: a rank without torch refuses it unread
    what = "torch.manual_seed"
    op = define(ctrl, aux_template(("seed", state[2]), (state[2],), _SEED, what))
    ident, result = ctrl.next_ident(), ctrl.next_id()
    ctrl.send_op((ident, result, op, (), stream.id, ()), new, what)
    ctrl.delete_ref(result)


def follow(ctrl, mesh, stream) -> None:
    """Before an op is sent to ``mesh``'s ranks: their settings are this process's
    (and their generators seeded, at the first op that reaches them)."""
    seen = _seen
    if seen[2] is not mesh.targets or seen[0]() is not ctrl or seen[1] != ctrl.generation:
        _seed_new_ranks(ctrl, mesh, stream)
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
