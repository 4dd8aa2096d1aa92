"""Values of mesh tensors on the controller: one shard, or every shard."""

from __future__ import annotations

import operator

import torch

from ...controller import AsyncResult
from ...protocol import aten
from ..remote import Ref, remote
from .tensor import Tensor


def shard_rank(t: Tensor, coords: dict) -> int:
    """The global rank at ``coords`` of ``t``'s mesh (dims not named: index 0)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"expected a mesh tensor (mnb.Tensor), got {type(t).__name__}")
    mesh = t.mesh
    names = list(mesh.dims)
    for d in coords:
        if d not in names:
            raise ValueError(f"mesh {mesh.name!r} has no dim {d!r} (dims: {names})")
    sl = mesh._slice
    rank = sl.offset
    for name, size, stride in zip(names, sl.sizes, sl.strides):
        i = coords.get(name, 0)
        if not isinstance(i, int) or isinstance(i, bool):
            raise TypeError(f"coordinate {name}={i!r}: expected an int")
        if not -size <= i < size:
            raise IndexError(f"coordinate {name}={i} out of range for dim {name!r} of size {size}")
        rank += (i % size) * stride
    return rank


def fetch_shard(t: Tensor, timeout: float | None = None, **coords) -> AsyncResult:
    """The AsyncResult of the shard of ``t`` at mesh coordinates ``coords``
    (``dp=1``; dims not named: 0), a local torch.Tensor."""
    rank = shard_rank(t, coords)
    return t.fetch_async(rank=rank, timeout=timeout)


def inspect(t: Tensor, timeout: float | None = None, **coords):
    """The shard of ``t`` at ``coords`` (default: the mesh's first rank) as a local
    tensor; blocks. A failure of the ops behind it on that rank is raised here. A
    local tensor (a host scalar such as a BatchNorm's ``num_batches_tracked`` or an
    optimizer's step count, which stay on the controller) is its own value."""
    if isinstance(t, torch.Tensor) and not isinstance(t, Tensor):
        return t
    return fetch_shard(t, timeout=timeout, **coords).result()


def worker_tensor(mesh, name: str) -> Tensor:
    """``mesh.tensor(name)``: the workers' variable ``name`` (a torch.Tensor on each
    rank, e.g. made by a ``%%monarch`` cell) as a mesh tensor; its layout is read
    once, from the mesh's first rank, and must be the same on every rank."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"mesh.tensor() needs a variable name, got {name!r}")
    ref = mesh.exec(name)
    try:
        layout = remote(aten.layout)(ref, mesh=mesh).fetch(rank=mesh.targets[0])
    except Exception:
        ref.delete()
        raise
    t = Tensor(layout, ref.id, mesh, ref.stream, ref.ident)
    ref._deleted = True  # t names the value now
    return t


_getitem = remote(operator.getitem)


def _tensor_of(ref: Ref, layout: tuple) -> Tensor:
    t = Tensor(layout, ref.id, ref.mesh, ref.stream, ref.ident)
    ref._deleted = True  # t names the value now
    return t


def outputs(ref: Ref, desc, mesh, stream):
    """The mesh tensors naming the worker value ``ref`` of layout description ``desc``
    (``protocol.aten.describe``): a tensor, a tuple or list of them, or ``ref`` itself."""
    if desc[0] == "one":
        return _tensor_of(ref, desc[1])
    if desc[0] == "value":
        return ref
    outs = []
    for i, layout in enumerate(desc[2]):
        item = _getitem._send((ref, i), {}, mesh, stream)
        outs.append(item if layout is None else _tensor_of(item, layout))
    ref.delete()
    return tuple(outs) if desc[1] == "tuple" else outs
