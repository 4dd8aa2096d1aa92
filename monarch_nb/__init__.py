"""monarch_nb: drive a mesh of GPU (or CPU) worker processes from a notebook.

The notebook kernel (or any Python process) is the single controller::

    import monarch_nb as mnb
    mesh = mnb.local_mesh(dp=2)
    x = mnb.remote(torch.ones)(4, mesh=mesh)
    x.fetch(rank=0)

In IPython, ``%load_ext monarch_nb`` adds ``%monarch_mesh`` and ``%%monarch``.
"""

import contextlib
import sys

from . import config
from ._version import __version__ as __version__
from .api import context
from .api.launch import attach, connect_mesh, k8s_manifest, local_mesh, slurm_mesh
from .api.mesh import DeviceMesh, Stream, get_mesh
from .api.recording import Compiled, RecordingError, compile
from .api.remote import TENSOR_ENGINE, ProcessGroup, Ref, RemoteFunction, remote
from .controller.async_result import AsyncResult
from .controller.errors import (
    InterruptTimeout,
    IOThreadError,
    MeshClosedError,
    RemoteError,
    WorkerCrashed,
    WorkerUnresponsive,
)
from .protocol.wire import RefUseError
from .worker.current import current_coords, current_rank, current_size


def _dashboard(mesh, **kw):
    """``mesh.dashboard()``: the widget comes from ``ui``, which the API never imports."""
    from .ui import Dashboard

    return Dashboard(mesh, **kw)


context.DASHBOARD.install(_dashboard)

_TENSOR_NAMES = ("Tensor", "fetch_shard", "inspect", "mesh_backend", "no_mesh")


def _tensor_mode(mesh):
    """``mesh.activate()`` enters the tensor engine's dispatch mode once torch is
    imported (the engine imports torch, which ``import monarch_nb`` does not)."""
    if "torch" not in sys.modules:
        return contextlib.nullcontext()
    from .api.tensor import mesh_mode

    return mesh_mode(mesh)


context.on_mesh_activation(_tensor_mode)


def _load_tensor_engine() -> None:
    """``mnb.remote(fn, propagate=...)`` before the engine loaded: load it now."""
    from .api import tensor  # noqa: F401 - registers itself with remote functions


TENSOR_ENGINE.install_loader(_load_tensor_engine)


def __getattr__(name):
    if name in _TENSOR_NAMES:  # the tensor engine (and torch) load on first use
        from .api import tensor

        return getattr(tensor, name)
    raise AttributeError(f"module 'monarch_nb' has no attribute {name!r}")


__all__ = [
    "AsyncResult",
    "Compiled",
    "DeviceMesh",
    "RecordingError",
    "compile",
    "config",
    "InterruptTimeout",
    "IOThreadError",
    "MeshClosedError",
    "ProcessGroup",
    "Ref",
    "RefUseError",
    "RemoteError",
    "RemoteFunction",
    "Stream",
    "Tensor",
    "WorkerCrashed",
    "WorkerUnresponsive",
    "attach",
    "connect_mesh",
    "k8s_manifest",
    "slurm_mesh",
    "current_coords",
    "current_rank",
    "current_size",
    "fetch_shard",
    "get_mesh",
    "inspect",
    "local_mesh",
    "mesh_backend",
    "no_mesh",
    "remote",
]


def _jupyter_labextension_paths():
    """Where the built JupyterLab extension lies (``jupyter labextension develop``)."""
    return [{"src": "labextension", "dest": "monarch-nb"}]


def load_ipython_extension(ipython):
    """``%load_ext monarch_nb``: register the magics."""
    from .notebook import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython):
    from .notebook import unload_ipython_extension as unload

    unload(ipython)
