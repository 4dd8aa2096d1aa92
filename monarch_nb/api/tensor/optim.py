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

from torch import optim
from torch.optim.optimizer import _foreach_supported_types as _optim_types
from torch.optim.optimizer import register_optimizer_step_pre_hook
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
    """The step pre-hook: a group of mesh tensors whose ``foreach`` is unset takes it,
    in an optimizer of ``SAME_NUMBERS`` (its own class, not a subclass: that may step
    otherwise)."""
    if type(optimizer) not in SAME_NUMBERS:
        return
    for group in optimizer.param_groups:
        if (
            group.get("foreach", False) is not None
            or group.get("fused")
            or group.get("differentiable")
        ):
            continue
        params = group["params"]
        if params and all(type(p) is Tensor or isinstance(p, Tensor) for p in params):
            group["foreach"] = True


register_optimizer_step_pre_hook(foreach_for_mesh_tensors)


for _types in (_util_types, _optim_types):
    if Tensor not in _types:
        _types.append(Tensor)
