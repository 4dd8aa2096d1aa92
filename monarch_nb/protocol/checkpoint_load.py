"""Worker side of ``mesh.load``: read a checkpoint that ``checkpoint_ops.save`` wrote
back into the worker's namespace with DCP, resharding where DCP can (DTensors,
replicated values onto any number of ranks) and saying where it cannot."""

from __future__ import annotations

import os
import pickle

from .checkpoint_ops import INFO, _agree, _first, _kind, _owner, _problem, quiet, where


def info(path: str) -> dict:
    """What the checkpoint at ``path`` holds ({"names": {name: entry}, "world": N}),
    or ``{"error": (kind, text)}``."""
    try:
        return _read(path)[0]
    except _Refused as e:
        return {"error": e.args[0]}


def optimizer_layouts(path: str, names: tuple) -> dict:
    """``{"layouts": {name: {"<param index>.<slot>": (shape, dtype)}}}`` of the
    optimizers ``names`` the checkpoint at ``path`` holds (the tensor engine gives a
    fresh optimizer that state before loading into it), or ``{"error": ...}``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        saved, md = _read(path)
    except _Refused as e:
        return {"error": e.args[0]}
    out: dict = {}
    for n in names:
        prefixes = (f"{n}.state.", f"{n}@rank0.state.")
        layouts = out[n] = {}
        for key, m in md.state_dict_metadata.items():
            for prefix in prefixes:
                if key.startswith(prefix) and isinstance(m, TensorStorageMetadata):
                    layouts[key[len(prefix):]] = (tuple(m.size), m.properties.dtype)
    return {"layouts": out}


class _Refused(Exception):
    """A problem to report as ``{"error": (kind, text)}``."""


def _read(path: str) -> tuple:
    import torch.distributed.checkpoint as dcp

    if not os.path.exists(path):
        raise _Refused(("FileNotFoundError", f"no checkpoint at {path}: it does not exist"))
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise _Refused(
            ("ValueError", f"{path} is not a checkpoint (it has no DCP .metadata file)")
        )
    reader = dcp.FileSystemReader(path)
    md = reader.read_metadata()
    if INFO not in md.state_dict_metadata:
        raise _Refused(
            ("ValueError", f"{path} is a DCP checkpoint but not one mesh.save wrote: "
             f"load it with torch.distributed.checkpoint.load")
        )
    box = {INFO: b""}
    with quiet(None):
        dcp.load(box, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return pickle.loads(box[INFO]), md


def _rebuild(entry: dict, device: str):
    import cloudpickle
    import torch

    module = cloudpickle.loads(entry["rebuild"])
    if device == "cuda" and torch.cuda.is_available():
        return module.to_empty(device=torch.device("cuda", torch.cuda.current_device()))
    return module.to_empty(device="cpu")


def _rebuild_optimizer(entry: dict, module):
    import cloudpickle

    cls, groups = cloudpickle.loads(entry["rebuild"])
    params = dict(module.named_parameters())
    return cls(
        [{k: v for k, v in g.items() if k != "fqns"} | {"params": [params[f] for f in g["fqns"]]}
         for g in groups]
    )


def _placeholder(ns: dict, name: str, key: str, entry: dict, md, made: dict):
    """What DCP loads ``name`` into (the live module's state dict, a tensor of the
    saved shape, ...); ``made``: modules and optimizers rebuilt here."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    kind, cur = entry["kind"], ns.get(name, made.get(name))
    if kind == "module":
        if not isinstance(cur, torch.nn.Module):
            if entry["rebuild"] is None:
                raise _Refused(
                    ("ValueError", f"{name!r} is a sharded module (FSDP2 or TP) in the "
                     f"checkpoint and is not defined on the workers: build it (and shard "
                     f"it) first, then load")
                )
            cur = made[name] = _rebuild(entry, entry["device"])
        return get_model_state_dict(cur)
    if kind == "optimizer":
        owner = entry["module"]
        module = made.get(owner, ns.get(owner)) if owner else None
        if not isinstance(cur, torch.optim.Optimizer):
            if entry["rebuild"] is None or not isinstance(module, torch.nn.Module):
                raise _Refused(
                    ("ValueError", f"optimizer {name!r} is not defined on the workers and "
                     f"cannot be rebuilt (its module {owner!r} is not loaded with it): "
                     f"define it first, then load")
                )
            cur = made[name] = _rebuild_optimizer(entry, module)
        if not isinstance(module, torch.nn.Module) or not _owns(module, cur):
            _, module = _owner(ns | made, cur, ())
        if module is None:
            from .checkpoint_ops import _holder

            module = _holder(cur)
        made.setdefault(f"{name}/module", module)
        _fresh_state(cur)
        return get_optimizer_state_dict(module, cur)
    if kind == "value":
        return b""
    saved = md.state_dict_metadata.get(key)
    if not isinstance(saved, TensorStorageMetadata):
        raise _Refused(("ValueError", f"{name!r}: the checkpoint holds no tensor under {key!r}"))
    if (
        torch.is_tensor(cur)
        and tuple(cur.shape) == tuple(saved.size)
        and cur.dtype == saved.properties.dtype
    ):
        return cur  # loaded in place: its device, sharding and views stay
    device = "cpu"
    if entry["device"] == "cuda" and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return torch.empty(tuple(saved.size), dtype=saved.properties.dtype, device=device)


def _fresh_state(opt) -> None:
    """Give an optimizer without state its state's entries (DCP's own zero step,
    which it skips while parameters hold gradients), so the load has them to fill."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    if opt.state:
        return
    params = [p for g in opt.param_groups for p in g["params"]]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        _init_optim_state(opt)
    finally:
        for p, g in zip(params, grads):
            p.grad = g


def _owns(module, opt) -> bool:
    have = {id(p) for p in module.parameters()}
    return all(id(p) in have for g in opt.param_groups for p in g["params"])


def _mismatch(name: str, key: str, placeholder, md) -> str | None:
    """The keys and shapes of ``name`` here that differ from the checkpoint's."""
    import torch
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    flat, _ = flatten_state_dict({key: placeholder})
    theirs = {k for k in md.state_dict_metadata if k.startswith(key + ".")}
    missing = sorted(k for k in flat if k not in md.state_dict_metadata)
    extra = sorted(theirs - set(flat))
    shapes = []
    for k, t in flat.items():
        m = md.state_dict_metadata.get(k)
        if torch.is_tensor(t) and isinstance(m, TensorStorageMetadata):
            if tuple(t.shape) != tuple(m.size):
                shapes.append(f"{_short(k, key)} {tuple(m.size)} there, {tuple(t.shape)} here")
    if not (missing or extra or shapes):
        return None
    parts = []
    if missing:
        parts.append(f"not in the checkpoint: {_names(missing, key)}")
    if extra:
        parts.append(f"in the checkpoint only: {_names(extra, key)}")
    if shapes:
        parts.append(f"shapes differ: {'; '.join(shapes[:10])}")
    return f"{name!r} does not match the checkpoint's: " + "; ".join(parts)


def _short(k: str, key: str) -> str:
    return k[len(key) + 1 :]


def _names(keys: list, key: str) -> str:
    shown = ", ".join(_short(k, key) for k in keys[:12])
    return shown + (f" and {len(keys) - 12} more" if len(keys) > 12 else "")


def load(ns: dict, path: str, names, group, engine: dict | None = None) -> dict:
    """Load ``names`` (all the checkpoint's when None) from ``path`` into ``ns``;
    ``engine``: name -> the state dict of a tensor engine module, loaded in place
    (its shards, here; the values of its host tensors are returned)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    me, world = where(group)
    problem, sd, keys, made = None, {}, {}, {}
    try:
        saved, md = _read(path)
        engine = engine or {}
        chosen = [n for n in saved["names"] if saved["names"][n]["kind"] != "engine"]
        chosen = (chosen if names is None else list(names)) + list(engine)
        unknown = [n for n in chosen if n not in saved["names"]]
        if unknown:
            raise _Refused(
                ("LookupError", f"not in the checkpoint at {path}: {', '.join(unknown)} "
                 f"(it holds {', '.join(saved['names'])})")
            )
        # modules before optimizers: an optimizer rebuilt needs its module
        chosen.sort(key=lambda n: saved["names"][n]["kind"] == "optimizer")
        for n in chosen:
            entry = saved["names"][n]
            if entry["per_rank"] and world != saved["world"]:
                raise _Refused(
                    ("ValueError", f"{n!r} differed across the {saved['world']} ranks that "
                     f"saved it (saved per rank), so it cannot go onto {world} ranks: only "
                     f"DTensors (FSDP2, TP) and values equal on every rank are resharded")
                )
            key = keys[n] = f"{n}@rank{me}" if entry["per_rank"] else n
            if entry["kind"] != "engine":
                sd[key] = _placeholder(ns, n, key, entry, md, made)
            if entry["kind"] == "engine":
                if n not in engine:
                    raise _Refused(("ValueError", f"{n!r} is a tensor engine module or "
                                    f"optimizer: pass it, mesh.load(path, {n}=obj)"))
                sd[key] = engine[n]
            if entry["kind"] in ("module", "optimizer", "engine"):
                wrong = _mismatch(n, key, sd[key], md)
                if wrong:
                    raise _Refused(("ValueError", wrong))
    except _Refused as e:
        problem = e.args[0]
    except (Exception, CheckpointException) as e:
        problem = ("RuntimeError", f"loading {path} failed: {type(e).__name__}: {e}")
    problem = _first(_agree({"problem": problem}, group))
    if problem is not None:
        return {"error": problem}
    try:
        reader = dcp.FileSystemReader(path)
        with quiet(group):
            dcp.load(sd, storage_reader=reader, process_group=group, no_dist=group is None)
    except (Exception, CheckpointException) as e:
        return {"error": _problem(e, f"reading {path} failed")}
    _bind(ns, saved, keys, sd, made)
    host = {n: _host_part(engine[n]) for n in engine}
    return {"ok": True, "names": list(keys), "host": host}


def _host_part(sd):
    """A loaded engine state dict with its shards (tensors of a dimension or more: the
    controller's mesh tensors, loaded in place here) as None; 0-dim tensors (host
    scalars) and plain values as they were read."""
    import torch

    if isinstance(sd, dict):
        return {k: _host_part(v) for k, v in sd.items()}
    if isinstance(sd, list | tuple):
        return type(sd)(_host_part(v) for v in sd)
    if torch.is_tensor(sd) and sd.dim() > 0:
        return None
    return sd


def _bind(ns: dict, saved: dict, keys: dict, sd: dict, made: dict) -> None:
    """Put what was read in place: modules and optimizers get their state, other
    names are bound to what was read."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    for n, key in keys.items():
        kind = saved["names"][n]["kind"]
        if kind == "module":
            module = ns[n] = made.get(n, ns.get(n))
            set_model_state_dict(module, sd[key])
        elif kind == "optimizer":
            opt = ns[n] = made.get(n, ns.get(n))
            set_optimizer_state_dict(made[f"{n}/module"], opt, sd[key])
        elif kind == "value":
            ns[n] = pickle.loads(sd[key])
        elif _kind(sd[key]) in ("tensor", "dtensor"):
            ns[n] = sd[key]
