"""Checkpoints of named worker variables: ``mesh.save(path, *names)`` and
``mesh.load(path)``, with torch.distributed.checkpoint (DCP) on the workers
(protocol/checkpoint_ops.py and checkpoint_load.py, sent as remote functions)."""

from __future__ import annotations

import os
import time
import uuid
from typing import TYPE_CHECKING

from ..controller.transfers import bar
from ..protocol import checkpoint_load, checkpoint_ops
from ..protocol.constants import PROGRESS_BYTES
from .remote import Ref, remote

if TYPE_CHECKING:
    from .mesh import DeviceMesh

_describe = remote(checkpoint_ops.describe)
_save = remote(checkpoint_ops.save)
_load = remote(checkpoint_load.load)
_info = remote(checkpoint_load.info)

_ERRORS = {
    "OSError": OSError,
    "NameError": NameError,
    "LookupError": LookupError,
    "ValueError": ValueError,
    "FileNotFoundError": FileNotFoundError,
    "RuntimeError": RuntimeError,
}


def _raise(error: tuple):
    kind, text = error
    raise _ERRORS.get(kind, RuntimeError)(text)


def _path(path, what: str) -> str:
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"{what} takes a checkpoint path, got {type(path).__name__}")
    return os.path.abspath(os.fspath(path))


def _names(names, what: str) -> tuple:
    for n in names:
        if not isinstance(n, str) or not n.isidentifier():
            raise ValueError(f"{what}: {n!r} is not a variable name")
    if len(set(names)) != len(names):
        raise ValueError(f"{what}: a name is given twice: {list(names)}")
    return tuple(names)


def _group(mesh: DeviceMesh):
    """The mesh's own process group (None for one rank without dims: no collectives)."""
    return mesh.process_group(tuple(mesh.dims)) if mesh.dims else None


def _engine(mesh: DeviceMesh, modules: dict, what: str) -> dict:
    """name -> the state dict of a controller-side module of mesh tensors (the
    tensor engine): mesh tensors go as their shards, host scalars by value."""
    out = {}
    for name, module in modules.items():
        state = getattr(module, "state_dict", None)
        if not callable(state):
            raise TypeError(
                f"{what}: {name}= takes a module of mesh tensors (built under "
                f"mesh.activate()), got {type(module).__name__}"
            )
        sd = dict(state())
        refs = [v for v in sd.values() if isinstance(v, Ref)]
        if not refs or any(r.mesh._controller is not mesh._controller for r in refs):
            raise ValueError(
                f"{what}: {name}= is not a module of mesh tensors on mesh {mesh.name!r} "
                f"(name worker variables as strings)"
            )
        out[name] = sd
    return out


def _call(fn, mesh: DeviceMesh, *args):
    """``fn(*args)`` on every rank, its Ref; mesh tensors among the arguments go as
    their shards (the tensor engine does not take this call)."""
    return fn._send(args, {}, mesh, mesh.default_stream)


def save(mesh: DeviceMesh, path, names: tuple, modules: dict, timeout: float | None) -> str:
    """See ``DeviceMesh.save``."""
    path = _path(path, "save()")
    names = _names(names + tuple(modules), "save()")[: len(names)]
    engine = _engine(mesh, modules, "save()")
    if not names and not engine:
        raise ValueError("save() needs the names of worker variables to save")
    parent = os.path.dirname(path)
    if os.path.isfile(path) or (
        os.path.isdir(path) and os.listdir(path)
        and not os.path.isfile(os.path.join(path, ".metadata"))
    ):
        raise FileExistsError(
            f"save(): {path} exists and is not a checkpoint: it is left alone (choose another path)"
        )
    ns = mesh.exec("globals()", stream=mesh.default_stream)
    try:
        seen = _describe(ns, names, mesh=mesh, stream=mesh.default_stream).fetch(timeout=timeout)
        for n in names:
            missing = [r for r, s in zip(mesh.ranks, seen) if s["kinds"][n] is None]
            if missing:
                where = "any rank" if len(missing) == mesh.size else f"ranks {missing}"
                raise NameError(f"save(): name {n!r} is not defined on {where} of mesh {mesh.name!r}")
        total = sum(s["bytes"] for s in seen)
        tmp = os.path.join(parent, f".{os.path.basename(path)}.saving-{uuid.uuid4().hex[:8]}")
        done = _call(_save, mesh, ns, names, path, tmp, _group(mesh), engine)
        done = done.fetch_async(timeout=timeout)
        if total > PROGRESS_BYTES:
            _watch(done, tmp, total, path)
        results = done.result()
    finally:
        ns.delete()
    for r in results:
        if "error" in r:
            _raise(r["error"])
    return path


def _watch(done, tmp: str, total: int, path: str) -> None:
    """A bar of the bytes written under ``tmp`` until ``done`` (where the controller
    sees the workers' file system; elsewhere it fills at the end)."""
    b = bar(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"saving {path}")
    if b is None:
        return
    try:
        while not done.wait(0.2):
            n = min(_written(tmp), total)
            if n > b.n:
                b.update(n - b.n)
        if b.n < total:
            b.update(total - b.n)
    finally:
        b.close()


def _written(folder: str) -> int:
    n = 0
    try:
        with os.scandir(folder) as it:
            for e in it:
                try:
                    n += e.stat().st_size
                except OSError:
                    pass
    except OSError:
        return 0
    return n


def load(mesh: DeviceMesh, path, names: tuple, modules: dict, timeout: float | None) -> list:
    """See ``DeviceMesh.load``."""
    path = _path(path, "load()")
    names = _names(names + tuple(modules), "load()")[: len(names)]
    engine = _engine(mesh, modules, "load()")
    ns = mesh.exec("globals()", stream=mesh.default_stream)
    try:
        chosen = names or (None if not engine else ())
        ref = _call(_load, mesh, ns, path, chosen, _group(mesh), engine)
        results = ref.fetch(timeout=timeout)
    finally:
        ns.delete()
    for r in results:
        if "error" in r:
            _raise(r["error"])
    for name, sd in engine.items():  # host scalars (a step count) live here
        for key, value in sd.items():
            if not isinstance(value, Ref) and key in results[0]["host"][name]:
                value.copy_(results[0]["host"][name][key])
    return results[0]["names"]


def contents(mesh: DeviceMesh, path, timeout: float | None = None) -> dict:
    """What the checkpoint at ``path`` holds, read by the mesh's first rank:
    name -> kind ("module", "optimizer", "dtensor", "tensor", "value")."""
    path = _path(path, "checkpoint_contents()")
    got = _info(path, mesh=mesh).fetch(rank=mesh.ranks[0], timeout=timeout)
    if "error" in got:
        _raise(got["error"])
    return {n: e["kind"] for n, e in got["names"].items()}


def restart_and_load(mesh: DeviceMesh, path, timeout: float | None = None) -> list:
    """``mesh.restart(restore=path)``: the path checked first (a restart that could
    not restore would lose the state for nothing: by the workers, or here when they
    are gone), then fresh workers, then load."""
    if mesh.alive:
        contents(mesh, path, timeout)
    else:
        full = _path(path, "restart(restore=...)")
        if not os.path.exists(full):
            raise FileNotFoundError(f"no checkpoint at {full}: it does not exist")
    start = time.monotonic()
    mesh._controller.restart()
    left = None if timeout is None else max(1.0, timeout - (time.monotonic() - start))
    return load(mesh, path, (), {}, left)


class MeshCheckpoints:
    """DeviceMesh's save, load and checkpoint_contents (a base of DeviceMesh)."""

    def save(self, path, *names: str, timeout: float | None = None, **modules) -> str:
        """Save the workers' variables ``names`` to the directory ``path`` with
        torch.distributed.checkpoint (per-rank shards, one metadata file): modules
        and optimizers (their state dicts), DTensors (FSDP2, TP: sharded), tensors
        and picklable values. Written beside ``path`` and renamed into place, so a
        failure leaves the checkpoint there as it was. ``name=module``: a module of
        mesh tensors (the tensor engine) saved as ``name``. Returns the absolute path."""
        return save(self, path, names, modules, timeout)

    def load(self, path, *names: str, timeout: float | None = None, **modules) -> list:
        """Load ``names`` (default: all) from the checkpoint at ``path`` into the
        workers: modules and optimizers in place, other names bound afresh.
        DTensors and values saved equal on every rank reshard onto a mesh of
        another size. ``name=module``: load ``name`` into a module of mesh tensors
        (the tensor engine) in place. Returns the names loaded."""
        return load(self, path, names, modules, timeout)

    def checkpoint_contents(self, path, timeout: float | None = None) -> dict:
        """Name -> kind of what the checkpoint at ``path`` holds."""
        return contents(self, path, timeout)
