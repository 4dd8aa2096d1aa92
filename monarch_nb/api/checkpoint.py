"""Checkpoints of named worker variables: ``mesh.save(path, *names)`` and
``mesh.load(path)``, with torch.distributed.checkpoint (DCP) on the workers
(protocol/checkpoint_ops.py and checkpoint_load.py, sent as remote functions)."""

from __future__ import annotations

import os
import sys
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
_layout = remote(checkpoint_load.optimizer_layouts)

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
    """name -> the state dict of a controller-side object of the tensor engine: a
    module or an optimizer of mesh tensors, or another object with ``state_dict`` and
    ``load_state_dict`` (an LR scheduler). Mesh tensors go as their shards, host
    scalars and plain values by value."""
    out = {}
    for name, obj in modules.items():
        if not callable(getattr(obj, "state_dict", None)) or not callable(
            getattr(obj, "load_state_dict", None)
        ):
            raise TypeError(
                f"{what}: {name}= takes a module or an optimizer of mesh tensors (built "
                f"under mesh.activate()) or a scheduler, got {type(obj).__name__}"
            )
        sd = obj.state_dict()
        refs = [v for v in _state_leaves(sd) if isinstance(v, Ref)]
        if any(r.mesh._controller is not mesh._controller for r in refs) or (
            not refs and _is_module(obj)
        ):
            raise ValueError(
                f"{what}: {name}= is not a module of mesh tensors on mesh {mesh.name!r} "
                f"(name worker variables as strings)"
            )
        out[name] = sd
    return out


def _is_module(obj) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


def _state_leaves(sd):
    """The values of a (nested) state dict: its dicts' values, its lists' items."""
    if isinstance(sd, dict):
        for v in sd.values():
            yield from _state_leaves(v)
    elif isinstance(sd, list | tuple):
        for v in sd:
            yield from _state_leaves(v)
    else:
        yield sd


def _merged(here, there):
    """``here`` (a state dict of mesh tensors, host tensors and values) with what was
    loaded ``there``: mesh tensors stay (loaded in place on the ranks), host tensors
    take the loaded value in place, plain values are replaced."""
    if isinstance(here, Ref):
        return here
    if isinstance(here, dict) and isinstance(there, dict):
        return {k: _merged(here[k], there[k]) if k in here else there[k] for k in there}
    if isinstance(here, list | tuple) and isinstance(there, list | tuple) and len(here) == len(
        there
    ):
        return type(here)(_merged(a, b) for a, b in zip(here, there))
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(here, torch.Tensor) and isinstance(there, torch.Tensor):
        here.copy_(there)
        return here
    return there


def _fresh_optimizer_state(mesh: DeviceMesh, opts: dict, path, timeout) -> list:
    """An optimizer that has not stepped has no state to load into: it gets the
    checkpoint's, zeros of each saved layout (mesh tensors shaped as their parameter;
    0-dim ones, a step count, as host tensors), which the load then fills. Returns
    the optimizers given state (a failed load takes it back)."""
    import torch

    fresh = {n: o for n, o in opts.items() if isinstance(o, torch.optim.Optimizer) and not o.state}
    if not fresh:
        return []
    got = _layout(path, tuple(fresh), mesh=mesh).fetch(rank=mesh.ranks[0], timeout=timeout)
    if "error" in got:
        _raise(got["error"])
    for name, opt in fresh.items():
        params = [p for g in opt.param_groups for p in g["params"]]
        for key, (shape, dtype) in got["layouts"][name].items():
            index, _, slot = key.partition(".")
            p = params[int(index)] if index.isdigit() and int(index) < len(params) else None
            if p is None:
                continue  # a parameter the checkpoint has and this optimizer lacks: load says so
            if tuple(shape) == ():
                value = torch.tensor(0.0, dtype=dtype)  # a host scalar, as torch.optim keeps
            else:
                value = torch.zeros_like(p, dtype=dtype)
            opt.state[p][slot] = value
    return list(fresh.values())


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
    filled = _fresh_optimizer_state(mesh, modules, path, timeout)
    try:
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
    except BaseException:
        for opt in filled:  # as it was: no state
            opt.state.clear()
        raise
    for name, sd in engine.items():  # host scalars (a step count) and values live here
        merged = _merged(sd, results[0]["host"][name])
        if not _is_module(modules[name]):  # an optimizer's groups, a scheduler's counts
            modules[name].load_state_dict(merged)
    return results[0]["names"]


def contents(mesh: DeviceMesh, path, timeout: float | None = None) -> dict:
    """What the checkpoint at ``path`` holds, read by the mesh's first rank:
    name -> kind ("module", "optimizer", "dtensor", "tensor", "value")."""
    return {n: e["kind"] for n, e in _entries(mesh, path, timeout).items()}


def _entries(mesh: DeviceMesh, path, timeout: float | None) -> dict:
    path = _path(path, "checkpoint_contents()")
    got = _info(path, mesh=mesh).fetch(rank=mesh.ranks[0], timeout=timeout)
    if "error" in got:
        _raise(got["error"])
    return got["names"]


def restart_and_load(
    mesh: DeviceMesh, path, setup: str | None = None, timeout: float | None = None
) -> list:
    """``mesh.restart(restore=path, setup=code)``: the path checked first (a restart
    that could not restore would lose the state for nothing: by the workers, or here
    when they are gone), then fresh workers, ``setup`` run on them (the code that
    builds and shards what the checkpoint cannot rebuild: FSDP2 and TP modules),
    then load."""
    if path is None:
        raise ValueError("restart(setup=...) goes with restore=PATH")
    if setup is not None:
        if not isinstance(setup, str):
            raise TypeError(f"setup= needs source text, got {type(setup).__name__}")
        compile(setup, "<restart setup>", "exec")  # a SyntaxError before anything stops
    if mesh.alive:
        entries = _entries(mesh, path, timeout)
        sharded = [n for n, e in entries.items() if e["kind"] == "module" and e["rebuild"] is None]
        if sharded and setup is None:
            raise ValueError(
                f"{', '.join(map(repr, sharded))} in the checkpoint: sharded module(s) (FSDP2 "
                "or TP), which fresh workers cannot rebuild; pass the code that builds (and "
                "shards) them: mesh.restart(restore=path, setup='...')"
            )
    else:
        full = _path(path, "restart(restore=...)")
        if not os.path.exists(full):
            raise FileNotFoundError(f"no checkpoint at {full}: it does not exist")
    start = time.monotonic()
    mesh._controller.restart()
    left = None if timeout is None else max(1.0, timeout - (time.monotonic() - start))
    if setup is not None:
        mesh.exec(setup + "\nNone").fetch(timeout=left)  # run for its effect: no value back
    return load(mesh, path, (), {}, left)


class MeshCheckpoints:
    """DeviceMesh's save, load and checkpoint_contents (a base of DeviceMesh)."""

    def save(self, path, *names: str, timeout: float | None = None, **modules) -> str:
        """Save the workers' variables ``names`` to the directory ``path`` with
        torch.distributed.checkpoint (per-rank shards, one metadata file): modules
        and optimizers (their state dicts), DTensors (FSDP2, TP: sharded), tensors
        and picklable values. Written beside ``path`` and renamed into place, so a
        failure leaves the checkpoint there as it was. ``name=obj``: a module or an
        optimizer of mesh tensors (the tensor engine), or its scheduler, saved as
        ``name``. Returns the absolute path."""
        return save(self, path, names, modules, timeout)

    def load(self, path, *names: str, timeout: float | None = None, **modules) -> list:
        """Load ``names`` (default: all) from the checkpoint at ``path`` into the
        workers: modules and optimizers in place, other names bound afresh.
        DTensors and values saved equal on every rank reshard onto a mesh of
        another size. ``name=obj``: load ``name`` into a module or an optimizer of
        mesh tensors (the tensor engine), or a scheduler, in place (an optimizer that
        has not stepped gets the saved state's layouts first). Returns the names loaded."""
        return load(self, path, names, modules, timeout)

    def checkpoint_contents(self, path, timeout: float | None = None) -> dict:
        """Name -> kind of what the checkpoint at ``path`` holds."""
        return contents(self, path, timeout)
