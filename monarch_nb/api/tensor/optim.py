"""Optimizers over mesh tensors take torch's foreach path by default.

torch picks the per-tensor path for tensors of a subclass and for CPU tensors, so an
optimizer of a CPU mesh's parameters would send one command per parameter and per
step of its update (AdamW: 8 per parameter). The foreach path sends those as a few
commands for all parameters, and on the ranks the foreach kernels run the same
per-tensor arithmetic (a step gives local torch's numbers exactly). A group that
says ``foreach=False`` (or ``fused``, or ``differentiable``) keeps its choice.

torch's utilities that choose foreach by the tensors' type (``clip_grad_norm_``,
``clip_grad_value_``, the optimizers' default) take mesh tensors as plain tensors, as
DTensor registers itself: a clip of 30 gradients is 2 commands, not 60, and takes the
path local torch takes.
"""

from __future__ import annotations

from torch.optim.optimizer import _foreach_supported_types as _optim_types
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._foreach_utils import _foreach_supported_types as _util_types

from .tensor import Tensor


def foreach_for_mesh_tensors(optimizer, args, kwargs) -> None:
    """The step pre-hook: a group of mesh tensors whose ``foreach`` is unset takes it."""
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
