"""Where API calls go when they do not say: the meshes by name, the active mesh
and stream of this thread, and the recording (``mnb.compile``) that watches the
commands sent.

``mesh.py`` and ``remote.py`` both build on this module and ``remote.py`` never
imports ``mesh.py``: a Ref recognises a mesh by its base class here
(``BaseMesh``) and resolves targets here (``resolve_target``).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import TYPE_CHECKING

from .. import config

# The controller's send() watches this object (its ``active`` trace observes every
# command sent); the API reaches it only through this module.
from ..controller.trace import RecordingError, recording_trace  # noqa: F401
from ..hooks import Hook

if TYPE_CHECKING:
    from .mesh import DeviceMesh

_meshes: dict[str, DeviceMesh] = {}  # root meshes by name
_default: list = [None]  # the most recently created mesh
_names = itertools.count()
_tls = threading.local()
DASHBOARD = Hook("dashboard", "(mesh, **kw) -> mesh.dashboard()'s widget, the package root's")


class BaseMesh:
    """The base class of ``DeviceMesh``: what the parts below ``mesh.py`` know a mesh by."""

    __slots__ = ()


class Stream:
    """A named queue and thread on every worker of a mesh (a CUDA stream on GPU)."""

    def __init__(self, mesh: DeviceMesh, stream_id: int, name: str):
        self.mesh = mesh
        self.id = stream_id
        self.name = name

    @contextlib.contextmanager
    def activate(self):
        """Within this block, calls without ``stream=`` go to this stream."""
        with activated("streams", self):
            yield self

    def borrow(self, t, mutable: bool = False):
        """``(t_on_this_stream, borrow)`` for a mesh tensor of another stream: its
        stream may not write ``t`` (nor read it, with ``mutable=True``) and this one
        may not write it (unless ``mutable``) until ``borrow.drop()``."""
        if not hasattr(t, "_layout"):
            raise TypeError(f"stream.borrow() takes a mesh tensor, not {type(t).__name__}")
        on_stream = t.borrow(self, mutable=mutable)
        return on_stream, on_stream._loan

    def interrupt(self, ranks=None) -> None:
        """KeyboardInterrupt in what this stream runs on its mesh's ranks (or ``ranks``);
        the other streams go on."""
        self.mesh._controller.interrupt((self.id,), self.mesh.ranks if ranks is None else ranks)

    def __repr__(self) -> str:
        return f"<Stream {self.name!r} of mesh {self.mesh.name!r}>"


def _stack(kind: str) -> list:
    s = getattr(_tls, kind, None)
    if s is None:
        s = []
        setattr(_tls, kind, s)
    return s


_activation_hooks: list = []  # mesh -> context manager, entered by each mesh activation


def on_mesh_activation(hook) -> None:
    """``hook(mesh)`` returns a context manager entered while ``mesh`` is active
    (the tensor engine enters its torch dispatch mode this way)."""
    _activation_hooks.append(hook)


@contextlib.contextmanager
def activated(kind: str, obj):
    """``obj`` is this thread's active ``kind`` ("meshes" or "streams") within the block."""
    stack = _stack(kind)
    stack.append(obj)
    try:
        if kind == "meshes" and _activation_hooks:
            with contextlib.ExitStack() as hooks:
                for hook in _activation_hooks:
                    hooks.enter_context(hook(obj))
                yield obj
        else:
            yield obj
    finally:
        stack.pop()


# ---------------------------------------------------------------- the registry


def new_name(name: str | None) -> str:
    """The name a new mesh gets: ``name`` checked, or the next free ``meshN``."""
    if name is None:
        name = f"mesh{next(_names)}"
        while name in _meshes:
            name = f"mesh{next(_names)}"
    elif not isinstance(name, str) or not name:
        raise ValueError("a mesh name must be a non-empty string")
    elif name in _meshes and _meshes[name].alive:
        raise ValueError(
            f"a mesh named {name!r} already exists: shut it down first or pick another name"
        )
    return name


def register(mesh: DeviceMesh) -> None:
    """A new root mesh: known by its name and the default from now on."""
    _meshes[mesh.name] = mesh
    _default[0] = mesh


def forget(mesh: DeviceMesh) -> None:
    """``mesh`` is shut down: drop it (and its slices) from the registry."""
    ctrl = mesh._controller
    known = _meshes.get(mesh.name)
    if known is not None and known._controller is ctrl:
        del _meshes[mesh.name]
    if _default[0] is not None and _default[0]._controller is ctrl:
        _default[0] = next(reversed(_meshes.values()), None)


def get_mesh(name: str | None = None) -> DeviceMesh:
    """The mesh called ``name``, or the active one."""
    if name is not None:
        try:
            return _meshes[name]
        except KeyError:
            raise KeyError(f"no mesh named {name!r} (meshes: {sorted(_meshes)})") from None
    active = _stack("meshes")
    if active:
        return active[-1]
    if _default[0] is None or not _default[0].alive and _default[0].name not in _meshes:
        raise RuntimeError("no active mesh: create one with mnb.local_mesh(dp=2) or pass mesh=")
    return _default[0]


def all_meshes() -> dict:
    """The root meshes by name."""
    return dict(_meshes)


# %config refuses restart settings while these run (a mesh whose controller was shut
# down without mesh.shutdown() is registered still, but runs nothing)
config.LIVE_MESHES.install(lambda: sorted(n for n, m in _meshes.items() if not m.closed))


def resolve_target(mesh: DeviceMesh | None, stream: Stream | None) -> tuple[DeviceMesh, Stream]:
    """The mesh and stream a call goes to: explicit, else active, else default."""
    if mesh is None:
        mesh = stream.mesh if stream is not None else get_mesh()
    elif not isinstance(mesh, BaseMesh):
        raise TypeError(f"mesh= must be a DeviceMesh, got {type(mesh).__name__}")
    if stream is None:
        active = _stack("streams")
        stream = active[-1] if active else None
        if stream is None or stream.mesh._controller is not mesh._controller:
            stream = mesh.default_stream
    elif not isinstance(stream, Stream):
        raise TypeError(
            f"stream= must be a Stream (mesh.stream(name)), got {type(stream).__name__}"
        )
    elif stream.mesh._controller is not mesh._controller:
        raise ValueError(f"{stream!r} does not belong to mesh {mesh.name!r}")
    return mesh, stream


# ---------------------------------------------------------------- the dashboard hook


def dashboard(mesh: DeviceMesh, **kw):
    """``mesh.dashboard()``: the widget of the DASHBOARD hook (the package root installs
    ``monarch_nb.ui``'s; the API imports no widgets)."""
    return DASHBOARD.require("no dashboard maker (monarch_nb.ui is not available)")(mesh, **kw)
