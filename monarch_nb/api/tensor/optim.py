"""Optimizers over mesh tensors take torch's foreach path by default, where it gives
the per-tensor path's numbers.

torch picks the per-tensor path for tensors of a subclass and for CPU tensors, so an
optimizer of a CPU mesh's parameters would send one command per parameter and per
step of its update (AdamW: 8 per parameter). The foreach path sends those as a few
commands for all parameters. For the optimizers of ``SAME_NUMBERS`` torch's foreach
path does the per-tensor path's arithmetic in the same order (a step gives local
torch's numbers exactly); the others' (NAdam, RAdam, ASGD, Adafactor, any optimizer of
the user's) round otherwise, so they keep torch's choice, as locally. A group that says
``foreach`` (or ``fused``, or ``differentiable``) keeps its choice.

torch's utilities that choose foreach by the tensors' type (``clip_grad_norm_``,
``clip_grad_value_``, the optimizers' default) take mesh tensors as plain tensors, as
DTensor registers itself: a clip of 30 gradients is 2 commands, not 60, and takes the
path local torch takes.
"""

from __future__ import annotations

import weakref

import torch
from torch import optim
from torch.optim.optimizer import _foreach_supported_types as _optim_types
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._foreach_utils import _foreach_supported_types as _util_types

from .tensor import Tensor

# each one's foreach path equals its per-tensor path bit for bit (as torch 2.13 writes
# them; tests/test_tensor.py checks it against the torch installed)
SAME_NUMBERS = frozenset(
    (
        optim.SGD, optim.Adam, optim.AdamW, optim.RMSprop,
        optim.Adagrad, optim.Adamax, optim.Adadelta, optim.Rprop,
    )
)


def foreach_for_mesh_tensors(optimizer, args, kwargs) -> None:
    """The step pre-hook: a group of mesh tensors whose ``foreach`` is unset takes it
    for this step, in an optimizer of ``SAME_NUMBERS`` (its own class, not a subclass:
    that may step otherwise). Not in a step torch.compile traces: there torch's choice
    (the per-tensor path) decomposes otherwise than the foreach path and gives the
    numbers a local compiled step gives; its graph is one command anyway. (Dynamo
    does not trace this package: it calls this hook between two graphs, where its
    frame callback is set.)"""
    if type(optimizer) not in SAME_NUMBERS or _compiled_call() is not None:
        return
    taken = []
    for i, group in enumerate(optimizer.param_groups):
        if (
            group.get("foreach", False) is not None
            or group.get("fused")
            or group.get("differentiable")
        ):
            continue
        params = group["params"]
        if params and all(type(p) is Tensor or isinstance(p, Tensor) for p in params):
            group["foreach"] = True
            taken.append(i)
    if taken:
        _taken[optimizer] = taken


def _unset_foreach(optimizer, args, kwargs) -> None:
    """The step post-hook: the groups the pre-hook set back to torch's choice (a
    state_dict, a later compiled step, see them as the user left them)."""
    taken = _taken.pop(optimizer, None)
    if taken:
        for i in taken:
            optimizer.param_groups[i]["foreach"] = None


try:  # not None within a call of a function torch.compile compiled
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _compiled_call
except ImportError:  # a torch without it: tracing is all that tells

    def _compiled_call():
        return True if torch.compiler.is_compiling() else None

_taken: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> groups set
register_optimizer_step_pre_hook(foreach_for_mesh_tensors)
register_optimizer_step_post_hook(_unset_foreach)


for _types in (_util_types, _optim_types):
    if Tensor not in _types:
        _types.append(Tensor)
