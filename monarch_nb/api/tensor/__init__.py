"""The tensor engine: torch code on the controller, shards on the mesh.

``with mesh.activate():`` enters ``mode.MeshMode``: every aten op becomes one
CallFunction on the mesh (``dispatch``), with output layouts from FakeTensor
propagation cached by input layout (``propagate``). ``mnb.Tensor`` (``tensor``)
is the result: a torch wrapper subclass and a Ref. ``values`` brings shards back.
"""

from . import backward as _backward  # noqa: F401 - installs mesh tensors' backward()
from . import dispatch as _dispatch  # noqa: F401 - installs mesh tensors' dispatch
from . import local_copies as _local_copies  # noqa: F401 - local tensors' copies stay local
from . import optim as _optim  # noqa: F401 - optimizers of mesh tensors take foreach
from . import remote_call as _remote_call  # noqa: F401 - registers with mnb.remote
from . import seed as _seed  # noqa: F401 - wraps torch.manual_seed
from . import traced as _traced  # noqa: F401 - installs mesh tensors' shards (compile)
from .graphs import mesh_backend
from .mode import mesh_mode, no_mesh
from .tensor import Tensor
from .values import fetch_shard, inspect

__all__ = ["Tensor", "fetch_shard", "inspect", "mesh_backend", "mesh_mode", "no_mesh"]
