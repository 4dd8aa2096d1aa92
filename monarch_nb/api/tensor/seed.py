"""``torch.manual_seed(s)`` under an active mesh seeds every rank of it too.

torch.manual_seed is Python, not an aten op, so no dispatch mode sees it: the
engine wraps it (``torch.manual_seed`` and ``torch.random.manual_seed`` name
the wrapper from the engine's first use on). Outside a mesh block, or inside
``no_mesh()``, the wrapper is torch's function. Every rank gets the same seed,
as Monarch's ``set_manual_seed_remote`` does by default: replicated parameters
start equal on every rank (data parallelism wants that); for streams that
differ per rank, seed in a remote function with ``mnb.current_rank()``.
"""

from __future__ import annotations

import functools

import torch

from ...protocol import aten
from ..remote import remote
from .mode import active_mesh

_torch_manual_seed = getattr(torch.random.manual_seed, "_mnb_wrapped", torch.random.manual_seed)
_seed_remote = remote(aten.manual_seed)


@functools.wraps(_torch_manual_seed)
def manual_seed(seed):
    mesh = active_mesh()
    if mesh is not None:
        # on the active stream: ops sent after it draw from the new seed
        _seed_remote(int(seed), mesh=mesh).delete()
    return _torch_manual_seed(seed)


manual_seed._mnb_wrapped = _torch_manual_seed
# pickle finds the wrapper as torch.random.manual_seed, so it still goes by reference
# (a worker resolves it to torch's function, or to this wrapper, which is the same there)
torch.random.manual_seed = manual_seed
torch.manual_seed = manual_seed
