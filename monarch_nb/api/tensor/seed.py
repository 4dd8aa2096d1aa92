"""``torch.manual_seed(s)`` under an active mesh seeds every rank of it too.

torch.manual_seed is Python, not an aten op, so no dispatch mode sees it: the
engine wraps it (``torch.manual_seed`` and ``torch.random.manual_seed`` name
the wrapper from the engine's first use on). Outside a mesh block, or inside
``no_mesh()``, the wrapper is torch's function. Every rank gets the same seed,
as Monarch's ``set_manual_seed_remote`` does by default: replicated parameters
start equal on every rank (data parallelism wants that); for streams that
differ per rank, seed in a remote function with ``mnb.current_rank()``.

``torch.get_rng_state()`` under an active mesh returns the ranks' CPU generator
states as a mesh tensor (each rank's own, without a round trip), and
``torch.set_rng_state(s)`` with one sets each rank's from its shard (a local state:
every rank's and the controller's): what ``torch.utils.checkpoint`` and
``torch.random.fork_rng`` do to draw a recomputed dropout mask again.
"""

from __future__ import annotations

import functools

import torch

from ...protocol import aten
from ..remote import remote
from .defaults import seeded_by_user
from .mode import active_mesh
from .tensor import Tensor

_torch_manual_seed = getattr(torch.random.manual_seed, "_mnb_wrapped", torch.random.manual_seed)
_torch_get_state = getattr(torch.random.get_rng_state, "_mnb_wrapped", torch.random.get_rng_state)
_torch_set_state = getattr(torch.random.set_rng_state, "_mnb_wrapped", torch.random.set_rng_state)
_seed_remote = remote(aten.manual_seed)
_set_state_remote = remote(aten.set_rng_state)
_STATE_BYTES = _torch_get_state().numel()  # an mt19937 generator's state: the same everywhere
_get_state_remote = remote(
    aten.rng_state, propagate=lambda: torch.empty(_STATE_BYTES, dtype=torch.uint8)
)


@functools.wraps(_torch_manual_seed)
def manual_seed(seed):
    mesh = active_mesh()
    if mesh is not None:
        # on the active stream: ops sent after it draw from the new seed
        seeded_by_user(mesh._controller, mesh)
        _seed_remote(int(seed), mesh=mesh).delete()
    return _torch_manual_seed(seed)


@functools.wraps(_torch_get_state)
def get_rng_state():
    mesh = active_mesh()
    if mesh is None:
        return _torch_get_state()
    return _get_state_remote(mesh=mesh)


@functools.wraps(_torch_set_state)
def set_rng_state(new_state):
    mesh = active_mesh()
    if isinstance(new_state, Tensor):  # each rank's own state
        _set_state_remote(new_state, mesh=new_state.mesh).delete()
        return None
    if mesh is not None:  # one state for every rank, and this process
        _set_state_remote(new_state, mesh=mesh).delete()
    return _torch_set_state(new_state)


# pickle finds each wrapper as torch's name, so it still goes by reference (a worker
# resolves it to torch's function, or to the wrapper, which is the same there)
for _name, _wrapper, _torch_fn in (
    ("manual_seed", manual_seed, _torch_manual_seed),
    ("get_rng_state", get_rng_state, _torch_get_state),
    ("set_rng_state", set_rng_state, _torch_set_state),
):
    _wrapper._mnb_wrapped = _torch_fn
    setattr(torch.random, _name, _wrapper)
    setattr(torch, _name, _wrapper)
