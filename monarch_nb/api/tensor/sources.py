"""``mesh.tensor(source)``: a mesh tensor of a workers' variable, or of local values.

Under ``mesh.activate()`` factories and ``torch.tensor(data)`` make mesh tensors, but a
tensor that is already local (a batch of a DataLoader over data loaded here) stays
local, and an op mixing it with mesh tensors is refused. ``mesh.tensor(x)`` is the
move, as ``x.to(device)`` moves a batch onto a GPU: every rank gets its values.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .dispatch import sent
from .tensor import Tensor
from .values import worker_tensor


def as_mesh_tensor(mesh, source) -> Tensor:
    """``source`` on ``mesh``: a variable name (``values.worker_tensor``), a mesh tensor
    (itself, or its copy on ``mesh``), or anything ``torch.as_tensor`` takes, whose
    values every rank of ``mesh`` then holds (same dtype, shape and strides)."""
    if isinstance(source, str):
        return worker_tensor(mesh, source)
    if isinstance(source, Tensor):
        return source if source.mesh is mesh else source.to_mesh(mesh)
    try:
        with _disable_current_modes():
            value = torch.as_tensor(source)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(
            f"mesh.tensor() takes a workers' variable name or a local tensor, array or "
            f"list, not {type(source).__name__}: {e}"
        ) from None
    if value.requires_grad:
        value = value.detach()
    return sent(value, mesh)
