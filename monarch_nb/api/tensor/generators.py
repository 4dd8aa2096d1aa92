"""Random ops given a local ``torch.Generator`` on a mesh: drawn here, as local torch draws.

``torch.randn(n, generator=g)`` under ``mesh.activate()`` (a DataLoader's sampler
given ``generator=``, ``nn.init.normal_(w, generator=g)``) used to send a copy of
``g`` to the ranks: ``g`` did not advance here, so the next draw repeated the last
one's numbers. Such an op now runs here on ``g`` (which advances as it would
locally), and its values go to every rank. The ops without ``generator=``, or
with torch's default generator named, use the ranks' own generators.
"""

from __future__ import annotations

import torch

from ...protocol.autograd import tensors_in
from ...protocol.wire import RefUseError
from ..context import RecordingError, recording_trace
from .plans import written
from .propagate import op_name
from .tensor import Tensor


def is_default_generator(gen: torch.Generator) -> bool:
    """Whether ``gen`` is torch's default CPU generator. An op's ``generator=``
    reaches a dispatch mode as a new Python object, so identity cannot tell: the
    default generator is changed for a moment, and ``gen`` follows it if it is it."""
    default = torch.default_generator
    if gen.device.type != "cpu":
        return False
    state = default.get_state()
    if not torch.equal(gen.get_state(), state):
        return False
    default.manual_seed(default.initial_seed() ^ 0x5EED)
    try:
        return not torch.equal(gen.get_state(), state)
    finally:
        default.set_state(state)


def draw(func, args: tuple, kwargs: dict) -> tuple:
    """``func`` run here with its local ``generator=``: ``(its local value, the mesh
    tensor it writes in place or None)``. Refused, naming the ranks' generators,
    where it would read a mesh tensor's values or cannot run here."""
    name = op_name(func)
    gen = kwargs["generator"]
    if recording_trace.active is not None:
        raise RecordingError(
            f"{name} draws from a local torch.Generator, here, at every call: a compiled "
            f"function cannot replay that; draw outside it, or leave out generator= (the "
            f"ranks' generators, seeded by torch.manual_seed under the mesh)"
        )
    writes = [t for t in written(func, args, kwargs) if isinstance(t, Tensor)]
    mesh_tensors = [t for t in tensors_in(args, kwargs) if isinstance(t, Tensor)]
    reads = [t for t in mesh_tensors if all(t is not w for w in writes)]
    if reads or len(writes) > 1 or gen.device.type != "cpu":
        raise RefUseError(
            f"{name} draws from a local torch.Generator ({gen.device}) "
            + ("with values of mesh tensors, which live on the ranks" if reads else "here")
            + ": leave out generator= to draw on the ranks from their own generators "
            "(torch.manual_seed under the mesh seeds them), or draw inside mnb.no_mesh() "
            "and compute there"
        )
    if not writes:
        return func(*args, **kwargs), None
    t = writes[0]
    if t.device.type != "cpu":  # local torch's own refusal
        raise RuntimeError(
            f"Expected a '{t.device.type}' device type for generator but found 'cpu'"
        )
    local = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
    args = tuple(local if a is t else a for a in args)
    func(*args, **{k: local if v is t else v for k, v in kwargs.items()})
    return local, t
