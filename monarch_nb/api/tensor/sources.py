"""``mesh.tensor(source)``: a mesh tensor of a workers' variable, or of local values.

Under ``mesh.activate()`` factories and ``torch.tensor(data)`` make mesh tensors, but a
tensor that is already local (a batch of a DataLoader over data loaded here) stays
local, and an op mixing it with mesh tensors is refused. ``mesh.tensor(x)`` is the
move, as ``x.to(device)`` moves a batch onto a GPU: every rank gets its values.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ...protocol import messages as m
from ...protocol.wire import function_ref, pack_args
from ..context import recording_trace
from .dispatch import sent, target
from .propagate import layout_of
from .tensor import Tensor
from .values import worker_tensor

_CLONE = function_ref(torch.clone)  # the ranks' own copy of the chunk that came


def as_mesh_tensor(mesh, source, split=None) -> Tensor:
    """``source`` on ``mesh``: a variable name (``values.worker_tensor``), a mesh tensor
    (itself, or its copy on ``mesh``), or anything ``torch.as_tensor`` takes, whose
    values every rank of ``mesh`` then holds (same dtype, shape and strides). With
    ``split`` (a dim name or names), its dim 0 is cut in equal chunks, and the rank at
    linear coordinate ``i`` of those dims holds chunk ``i`` (DTensor's ``Shard(0)``; a
    data-parallel batch)."""
    if isinstance(source, str) and split is None:
        return worker_tensor(mesh, source)
    if isinstance(source, Tensor) and split is None:
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
    if split is None:
        return sent(value, mesh)
    if value.is_complex():  # a max is not defined on complex numbers: split the real view
        return torch.view_as_complex(as_mesh_tensor(mesh, torch.view_as_real(value), split))
    dims = (split,) if isinstance(split, str) else tuple(split)
    unknown = [d for d in dims if d not in mesh.dims]
    if unknown or not dims:
        raise ValueError(f"mesh.tensor(split=...): {split!r} names no dims of {mesh.dims}")
    n = 1
    for d in dict.fromkeys(dims):
        n *= mesh.dims[d]
    rows = value.shape[0] if value.dim() else 0
    if rows % n or not rows:
        raise ValueError(
            f"mesh.tensor(split={split!r}): dim 0 of size {rows} does not split in {n} "
            f"equal chunks (one per coordinate of {dims})"
        )
    if recording_trace.active is not None:  # a compiled call: one command for every rank
        chunks = sent(value.reshape(n, rows // n, *value.shape[1:]), mesh)
        # a max over equal copies is each of them, exactly: rank i keeps chunk i
        return chunks.reduce(dims, "max", scatter=True)
    return _each_its_chunk(value, mesh, dims, n)


def _each_its_chunk(value: torch.Tensor, mesh, dims: tuple, n: int) -> Tensor:
    """A mesh tensor whose value on the ranks at linear coordinate ``i`` of ``dims``
    (in mesh order, as a scatter's members) is chunk ``i`` of ``value``'s dim 0: one
    command to each group of ranks, each carrying its chunk alone, all naming one value
    (a group fails its own ranks' value)."""
    names = [d for d in mesh.dims if d in dims]
    groups: list = [[] for _ in range(n)]
    for rank in mesh.targets:
        at = mesh.coords(rank)
        i = 0
        for d in names:
            i = i * mesh.dims[d] + at[d]
        groups[i].append(rank)
    size = value.shape[0] // n
    mesh, stream, ctrl = target([], mesh, "mesh.tensor(split=...)", ())
    result = ctrl.next_id()
    ident = None
    for i, ranks in enumerate(groups):
        chunk = value[i * size : (i + 1) * size].contiguous()
        if i == 0:
            layout = layout_of(chunk)
        packed, _ = pack_args((chunk,), {})
        ident = ctrl.next_ident()
        msg = m.CallFunction(ident, result, _CLONE, packed, stream.id, mesh.id, "mesh.tensor")
        ctrl.send(msg, tuple(ranks), stream.id, "mesh.tensor")
    out = Tensor(layout, result, mesh, stream, ident)
    if mesh.device_type == "cuda":  # onto each rank's GPU, as torch.tensor(data)
        return out.to("cuda")
    return out
