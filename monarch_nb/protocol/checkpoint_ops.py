"""Worker side of checkpoints (``mesh.save`` / ``mesh.load``: monarch_nb/api/checkpoint.py).

torch.distributed.checkpoint (DCP) over the worker's namespace: the controller sends
these as remote functions with the namespace (a Ref of ``globals()``) and the mesh's
process group, and every rank of the mesh runs them together. Each rank decides
what is wrong on its own side, the ranks agree (one all_gather_object) and either
all go on or all return the same problem, ``{"error": (kind, text)}``, which the
controller raises: nothing is half done and no collective is left waiting.

In the checkpoint a name's value is under its name (modules and optimizers as DCP's
state dicts, DTensors sharded, plain tensors and values once), or under
``name@rankN`` per rank when it differed across ranks; ``__monarch_nb__`` holds
what each name was (its kind, whether per rank, the world size, how to rebuild a
plain module or optimizer on fresh workers).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import shutil
import warnings

INFO = "__monarch_nb__"
VERSION = 1


def _kind(v) -> str:
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(v, torch.nn.Module):
        return "module"
    if isinstance(v, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(v, DTensor):
        return "dtensor"
    if isinstance(v, torch.Tensor):
        return "tensor"
    return "value"


def _tensor_bytes(t) -> int:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def describe(ns: dict, names: tuple) -> dict:
    """This rank's view of ``names``: name -> its kind (None: not defined), and
    ``"bytes"``: about how much of it this rank would write."""
    import torch

    out, size = {}, 0
    for n in names:
        v = ns.get(n, _MISSING)
        out[n] = None if v is _MISSING else _kind(v)
        if isinstance(v, torch.nn.Module):
            size += sum(_tensor_bytes(t) for t in v.state_dict().values() if torch.is_tensor(t))
        elif torch.is_tensor(v):
            size += _tensor_bytes(v)
    return {"kinds": out, "bytes": size}


_MISSING = object()


# ------------------------------------------------------------------ what goes in


def _owner(ns: dict, opt, prefer: tuple):
    """(name, module) of the smallest module holding every parameter of ``opt``:
    among the names saved first, then the namespace; (None, None) when none does."""
    import torch

    want = {id(p) for g in opt.param_groups for p in g["params"]}
    best = None
    for pool in (prefer, sorted(k for k in ns if not k.startswith("_"))):
        for n in pool:
            m = ns.get(n)
            if isinstance(m, torch.nn.Module):
                have = {id(p) for p in m.parameters()}
                if want <= have and (best is None or len(have) < best[2]):
                    best = (n, m, len(have))
        if best is not None:
            return best[0], best[1]
    return None, None


def _holder(opt):
    """A module whose parameters are ``opt``'s, named p0, p1, ... (an optimizer whose
    module is nowhere in the namespace)."""
    import torch

    m = torch.nn.Module()
    i = 0
    for g in opt.param_groups:
        for p in g["params"]:
            m.register_parameter(f"p{i}", p)
            i += 1
    return m


def _state(ns: dict, name: str, names: tuple) -> tuple:
    """(what DCP saves for ``name``, how to rebuild it or None, its optimizer's module name)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    v = ns[name]
    kind = _kind(v)
    if kind == "module":
        return get_model_state_dict(v), _skeleton(v), None
    if kind == "optimizer":
        owner, module = _owner(ns, v, names)
        rebuild = None
        if module is None:
            module = _holder(v)
        else:
            fqn = {id(p): k for k, p in module.named_parameters()}
            groups = [
                {"fqns": [fqn[id(p)] for p in g["params"]]}
                | {k: x for k, x in g.items() if k != "params"}
                for g in v.param_groups
            ]
            rebuild = _dumps((type(v), groups))
        return get_optimizer_state_dict(module, v), rebuild, owner
    if kind == "value":
        return _dumps(v), None, None
    return v, None, None


def _dumps(v) -> bytes:
    import cloudpickle

    return cloudpickle.dumps(v)


def _skeleton(module) -> bytes | None:
    """``module`` pickled with its saved tensors as meta tensors (rebuilt on fresh
    workers, then filled by the load); None for a sharded one (FSDP2, TP)."""
    import cloudpickle
    import torch
    from torch.distributed.tensor import DTensor

    sd = module.state_dict()
    if any(isinstance(t, DTensor) for t in sd.values()):
        return None
    saved = {t.data_ptr() for t in sd.values() if torch.is_tensor(t) and t.numel()}

    class Pickler(cloudpickle.Pickler):
        def reducer_override(self, obj):
            if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.data_ptr() in saved:
                param = isinstance(obj, torch.nn.Parameter)
                return _meta, (tuple(obj.shape), obj.dtype, param, obj.requires_grad)
            return super().reducer_override(obj)

    import io

    f = io.BytesIO()
    try:
        Pickler(f).dump(module)
    except Exception:
        return None
    return f.getvalue()


def _meta(shape, dtype, param: bool, requires_grad: bool):
    import torch

    t = torch.empty(shape, dtype=dtype, device="meta")
    return torch.nn.Parameter(t, requires_grad) if param else t


def _digest(value) -> str:
    """Equal on every rank when the value is replicated (DTensors: always)."""
    import torch
    from torch.distributed.tensor import DTensor

    h = hashlib.blake2b(digest_size=16)

    def visit(x):
        if isinstance(x, DTensor):
            h.update(b"dtensor")
        elif torch.is_tensor(x):
            t = x.detach().cpu().contiguous()
            h.update(repr((tuple(t.shape), t.dtype)).encode())
            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(repr(k).encode())
                visit(x[k])
        elif isinstance(x, list | tuple):
            for y in x:
                visit(y)
        elif isinstance(x, bytes):
            h.update(x)
        else:
            h.update(repr(x).encode())

    visit(value)
    return h.hexdigest()


def where(group) -> tuple:
    """(this rank's index, the ranks): in ``group``, or (0, 1) for a mesh of one
    rank and no dims (``group`` None: DCP runs without collectives)."""
    import torch.distributed as dist

    return (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))


@contextlib.contextmanager
def quiet(group):
    """Without a group, DCP's "assuming the intent is to ... in a single process" unsaid."""
    with warnings.catch_warnings():
        if group is None:
            warnings.simplefilter("ignore", UserWarning)
        yield


def _agree(mine: dict, group) -> list:
    """Every rank's ``mine``, in group order, on every rank."""
    import torch.distributed as dist

    if group is None:
        return [mine]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, mine, group=group)
    return out


def _first(gathered: list):
    return next((g["problem"] for g in gathered if g["problem"] is not None), None)


def _problem(e: BaseException, doing: str, full: bool = False) -> tuple:
    """``(kind, message)`` of a failed write; ``full``: the disk was found full after it
    (torch's zip writer reports a short write as a RuntimeError of its own)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException):  # the ranks' own errors: an OSError first
        errors = [x[0] if isinstance(x, tuple) else x for _, x in sorted(e.failures.items())]
        e = next((x for x in errors if isinstance(x, OSError)), errors[0] if errors else e)
    if full and not isinstance(e, OSError):
        why = f"{type(e).__name__}: {e}"
        return ("OSError", f"{doing}: OSError: [Errno 28] No space left on device ({why})")
    kind = "OSError" if isinstance(e, OSError) else "RuntimeError"
    return (kind, f"{doing}: {type(e).__name__}: {e}")


def _no_space(where: str) -> bool:
    """Whether the filesystem of ``where`` has no room left (under one page)."""
    try:
        return shutil.disk_usage(where).free < 4096
    except OSError:
        return False


# ------------------------------------------------------------------ save


def save(ns: dict, names: tuple, path: str, tmp: str, group, engine: dict | None = None) -> dict:
    """Write ``names`` to ``tmp`` with DCP, then (the mesh's first rank) put it at
    ``path``, replacing what was there only once the new one is whole. ``engine``:
    name -> the state dict of a tensor engine module (its shards, here)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    me = where(group)[0]
    problem, states, entries, digests = None, {}, {}, {}
    try:
        for n in names:
            if n not in ns:
                raise NameError(f"name {n!r} is not defined on rank {dist.get_rank()}")
            try:
                state, rebuild, owner = _state(ns, n, names)
            except Exception as e:
                raise RuntimeError(f"{n!r} cannot be saved: {type(e).__name__}: {e}") from e
            states[n] = state
            entries[n] = {
                "kind": _kind(ns[n]),
                "rebuild": rebuild,
                "module": owner,
                "device": _device(ns[n]),
            }
            digests[n] = _digest(state)
        for n, state in (engine or {}).items():
            states[n] = state
            entries[n] = {"kind": "engine", "rebuild": None, "module": None, "device": "cpu"}
            digests[n] = _digest(state)
    except Exception as e:
        problem = ("NameError" if isinstance(e, NameError) else "RuntimeError", str(e))
    gathered = _agree({"problem": problem, "digests": digests}, group)
    problem = _first(gathered)
    if problem is not None:
        return {"error": problem}
    world = len(gathered)
    sd = {}
    for n in states:
        per_rank = len({g["digests"][n] for g in gathered}) > 1
        entries[n]["per_rank"] = per_rank
        sd[f"{n}@rank{me}" if per_rank else n] = states[n]
    sd[INFO] = pickle.dumps({"version": VERSION, "world": world, "names": entries})
    try:
        writer = dcp.FileSystemWriter(tmp, overwrite=False)
        with quiet(group):
            dcp.save(sd, storage_writer=writer, process_group=group, no_dist=group is None)
    except (Exception, CheckpointException) as e:
        full = _no_space(os.path.dirname(tmp) or ".")  # before the temporary goes
        if me == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        return {"error": _problem(e, f"writing the checkpoint failed, {path} is unchanged", full)}
    if me != 0:
        return {"ok": True}
    try:
        _replace(tmp, path)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        return {"error": ("OSError", f"putting the checkpoint at {path} failed: {e}")}
    return {"ok": True, "per_rank": [n for n in states if entries[n]["per_rank"]]}


def _device(v) -> str:
    import torch

    if isinstance(v, torch.nn.Module):
        t = next(iter(v.state_dict().values()), None)
        return "cpu" if t is None or not torch.is_tensor(t) else t.device.type
    return v.device.type if torch.is_tensor(v) else "cpu"


def _replace(tmp: str, path: str) -> None:
    """``tmp`` becomes ``path``; an old checkpoint there goes only once that is done."""
    old = None
    if os.path.lexists(path):
        old = tmp + ".old"
        os.rename(path, old)
    try:
        os.rename(tmp, path)
    except OSError:
        if old is not None:
            os.rename(old, path)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
