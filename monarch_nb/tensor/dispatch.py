"""One aten op on mesh tensors -> one CallFunction on the mesh.

The op's output layouts come from ``propagate`` once per (op, argument key),
where the key holds every input tensor's layout, which inputs are the same
tensor, and the other arguments with their types; a repeated op costs a key,
a dict lookup, a pickle and a send.
"""

from __future__ import annotations

import itertools
import operator
import weakref

import torch

from ..context import recording_trace, resolve_target
from ..protocol import messages as m
from ..protocol.aten import OpSlot, alias_after, run_op
from ..protocol.pickling import pack_ref_args, ref_placeholder
from ..protocol.wire import RefUseError, function_ref, pack_args, register_ref_type
from ..remote import check_refs
from . import borrows
from .propagate import layout_of, op_name, propagate
from .tensor import Tensor

_RUN_OP = function_ref(run_op)
_GETITEM = function_ref(operator.getitem)
_ALIAS = function_ref(alias_after)
_MARK = object()
_marks = [(_MARK, i) for i in range(64)]
_LOCAL = object()
_SCALARS = (float, bool, complex)
_LIFTS = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}
_CUDA = torch.device("cuda")
_cache: dict = {}
_names: dict = {}  # id(op) -> (qualified name for run_op, display name, the op)
_CACHE_MAX = 100_000
# op templates: key -> (op id, its DefineOp); a worker set learns each once per generation
_templates: dict = {}
_op_ids = itertools.count(1)
_defined: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # ctrl -> (gen, {op id})
_mutates: dict = {}  # key -> inputs the op writes and does not return (a foreach op's lists)


def _key(x, tensors: list, local: list):
    """A hashable stand-in for an argument; collects mesh tensors and local ones."""
    tp = type(x)
    if tp is int or tp is str or x is None:
        return x
    if tp is Tensor:
        for i, y in enumerate(tensors):
            if y is x:
                return _marks[i] if i < 64 else (_MARK, i)
        i = len(tensors)
        tensors.append(x)
        return _marks[i] if i < 64 else (_MARK, i)
    if tp is list or tp is tuple:
        return tuple([_key(y, tensors, local) for y in x])
    if tp in _SCALARS:  # 1.0 == 1 == True, but they promote differently
        return (tp, x)
    if isinstance(x, torch.Tensor):
        if isinstance(x, Tensor):  # a subclass of ours
            tensors.append(x)
            return (_MARK, len(tensors) - 1)
        local.append(x)
        return (_LOCAL, len(local) - 1, x.dtype, x.dim())
    return x


def _local_error(name: str, t: torch.Tensor, mesh) -> RefUseError:
    return RefUseError(
        f"{name} mixes a local tensor (shape {tuple(t.shape)}, {t.dtype}) with mesh "
        f"tensors of mesh {mesh.name!r}: create it on the mesh instead (factories and "
        f"torch.tensor(...) inside 'with mesh.activate():' make mesh tensors), or bring "
        f"the mesh tensor's shard here with mnb.inspect(t) and compute locally "
        f"(inside 'with mnb.no_mesh():' factories are local too)"
    )


def dispatch(func, args, kwargs, mesh=None):
    """Run ``func`` on the shards of its mesh tensors (or, for a factory, on
    ``mesh``): returns mesh tensors with the layouts FakeTensor predicts."""
    tensors: list = []
    local: list = []
    # id(func): OpOverloads live as long as torch, and their __hash__ is Python code
    kw = _key(tuple(kwargs.items()), tensors, local) if kwargs else ()
    key = (id(func), _key(args, tensors, local), kw)
    if not tensors and mesh is not None and kwargs.get("device") is not None:
        # a factory: torch fills in the CPU default; a CUDA mesh's default is its GPU
        if _device_type(kwargs["device"]) == "cpu" and mesh.device_type == "cuda":
            kwargs = dict(kwargs, device=_CUDA)
            key = (id(func), key[1], _key(tuple(kwargs.items()), tensors, local))
    if tensors:
        key += tuple([t._layout for t in tensors])
    if mesh is None:
        if not tensors:
            raise RuntimeError(f"{op_name(func)}: no mesh tensor among its arguments")
        mesh = tensors[0].mesh
    entry = None
    to_gpu = False
    if local:
        if func in _LIFTS:
            if local[0].dim() == 0:  # torch.tensor(0.0): a host scalar, as torch.optim wants
                return func(*args, **kwargs)
            entry = ("one", layout_of(local[0]), None)  # torch.tensor(data): data to every rank
            to_gpu = mesh.device_type == "cuda"  # ... and onto each rank's GPU
        elif not tensors:  # local tensors only (an inspected shard, its repr): local torch
            return func(*args, **kwargs)
        else:
            for t in local:  # like CPU scalars with CUDA tensors: 0-dim ones go by value
                if t.dim() != 0 or t.requires_grad:
                    raise _local_error(op_name(func), t, mesh)
    if entry is None:
        try:
            entry = _cache.get(key)
        except TypeError:  # an unhashable argument: propagate every time
            key, entry = None, None
        if entry is None:
            entry = propagate(func, args, kwargs, tensors, _is_mesh)
            _check_device(entry, func, mesh)
            _names_of(func)  # keeps func alive: its id in the key stays its own
            mutated = _mutated_inputs(func, args, kwargs, tensors, entry)
            if key is not None:
                if len(_cache) >= _CACHE_MAX:
                    _cache.clear()
                    _templates.clear()
                    _mutates.clear()
                _cache[key] = entry
                if mutated:
                    _mutates[key] = mutated
        else:
            mutated = _mutates.get(key, ()) if _mutates else ()
    else:
        mutated = ()
    mesh, stream = resolve_target(mesh, None)
    if tensors:
        check_refs(tensors, mesh, stream)
        if borrows.live[0]:
            borrows.check(op_name(func), tensors, _written(entry, mutated))
    ctrl = mesh._controller
    ctrl.check_usable(mesh.targets)
    names = _names.get(id(func)) or _names_of(func)
    what = names[1]
    if local:
        packed, _ = pack_args((names[0], *args), kwargs)
        result, ident = ctrl.next_id(), ctrl.next_ident()
        ctrl.send(
            m.CallFunction(ident, result, _RUN_OP, packed, stream.id, mesh.id, what),
            mesh.targets,
            stream.id,
            what,
        )
    else:

        def define(op: int) -> m.DefineOp:
            index = {id(t): i for i, t in enumerate(tensors)}
            skeleton = (names[0], *_skeleton(args, index))
            return m.DefineOp(op, _RUN_OP, skeleton, _skeleton(kwargs, index), what)

        result, ident = _run(
            ctrl, key, define, (names[0], *args), kwargs, tensors, mesh, stream, what
        )
    for j in mutated:  # before the op's own value may be freed below
        _rename(tensors[j], _Holder(result), mesh, stream)
        if tensors[j]._aliases is not None:
            _rename_aliases(tensors[j], mesh, stream)
    kind = entry[0]
    if kind == "relayout":
        _relayout(tensors[entry[1]], func, args, kwargs, entry[2])
        return _output(entry[1], None, result, ident, mesh, stream, tensors)
    if kind == "one":
        out = _output(entry[1], entry[2], result, ident, mesh, stream, tensors)
        if to_gpu:
            return dispatch(torch.ops.aten._to_copy.default, (out,), {"device": _CUDA})
        return out
    if kind == "value":
        ctrl.delete_ref(result)
        return entry[1]
    outs = []
    for i, (spec, base) in enumerate(zip(entry[2], entry[3])):
        if spec is None:
            outs.append(None)
            continue
        rid, rident = _run(
            ctrl,
            ("getitem", i, what),
            lambda op, i=i: m.DefineOp(op, _GETITEM, (OpSlot(0), i), {}, what),
            (_Holder(result), i),
            {},
            (_Holder(result),),
            mesh,
            stream,
            what,
        )
        outs.append(_output(spec, base, rid, rident, mesh, stream, tensors))
    ctrl.delete_ref(result)
    return entry[1](outs)


def _relayout(t: Tensor, func, args, kwargs, layout: tuple) -> None:
    """An in-place view op changed ``t``'s layout on every rank: change the wrapper's
    (as torch's return_and_correct_aliasing does: the op on meta, nowhere else)."""
    with torch.utils._mode_utils.no_dispatch():
        meta = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            func(*args, **kwargs)
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta)
    t._layout = layout


def _written(entry, mutated: tuple) -> tuple:
    """Indices of the input tensors an op writes (in place, ``out=``, or a foreach list)."""
    if entry[0] in ("one", "relayout"):
        return (entry[1], *mutated) if type(entry[1]) is int else mutated
    if entry[0] == "many":
        return (*[s for s in entry[2] if type(s) is int], *mutated)
    return mutated


def _device_type(device) -> str:
    return device.type if isinstance(device, torch.device) else torch.device(device).type


def _check_device(entry, func, mesh) -> None:
    """A CUDA result on a mesh without GPUs is refused at the call."""
    if entry[0] == "one":
        specs = [entry[1]]
    elif entry[0] == "many":
        specs = entry[2]
    else:
        return
    for spec in specs:
        if type(spec) is tuple and spec[4].type == "cuda" and mesh.device_type != "cuda":
            raise RefUseError(
                f"{op_name(func)} makes a CUDA tensor, but the workers of mesh {mesh.name!r} "
                f"have no GPUs (its tensors live on the CPU): leave them on the mesh's device"
            )


def _mutated_inputs(func, args, kwargs, tensors: list, entry) -> tuple:
    """Indices (in ``tensors``) of the inputs ``func`` writes without returning them."""
    schema = getattr(func, "_schema", None)
    if schema is None or not tensors:
        return ()
    index = {id(t): i for i, t in enumerate(tensors)}
    found, pos = [], 0
    for a in schema.arguments:
        if a.kwarg_only:
            v = kwargs.get(a.name)
        else:
            v = args[pos] if pos < len(args) else kwargs.get(a.name)
            pos += 1
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        for t in v if isinstance(v, (list, tuple)) else (v,):
            if isinstance(t, Tensor) and id(t) in index:
                found.append(index[id(t)])
    returned = set()
    if entry[0] in ("one", "relayout") and type(entry[1]) is int:
        returned.add(entry[1])
    elif entry[0] == "many":
        returned.update(s for s in entry[2] if type(s) is int)
    return tuple(j for j in dict.fromkeys(found) if j not in returned)


def _skeleton(x, index: dict):
    """``x`` with each mesh tensor replaced by the OpSlot of its place in ``index``."""
    tp = type(x)
    if tp is Tensor or isinstance(x, Tensor):
        return OpSlot(index[id(x)])
    if tp is list or tp is tuple:
        return tp(_skeleton(y, index) for y in x)
    if tp is dict:
        return {k: _skeleton(v, index) for k, v in x.items()}
    return x


def _run(ctrl, key, define, args, kwargs, refs, mesh, stream, what: str) -> tuple:
    """Send one op: a RunOp of the template ``key`` (made by ``define(op id)`` and
    defined on every worker first), or, while ``mnb.compile`` records or the key
    is unhashable, a CallFunction of its arguments. Returns (result id, ident)."""
    result, ident = ctrl.next_id(), ctrl.next_ident()
    if key is None or recording_trace.active is not None:
        function = _RUN_OP if type(args[0]) is str else define(0).function
        packed = pack_ref_args(args, kwargs, tuple([r.id for r in refs]))
        msg = m.CallFunction(ident, result, function, packed, stream.id, mesh.id, what)
        ctrl.send(msg, mesh.targets, stream.id, what)
        return result, ident
    t = _templates.get(key)
    if t is None:
        op = next(_op_ids)
        t = _templates[key] = (op, define(op))
    seen = _defined.get(ctrl)
    if seen is None or seen[0] != ctrl.generation:
        seen = _defined[ctrl] = (ctrl.generation, set())
    if t[0] not in seen[1]:
        ctrl.send(t[1], None)
        seen[1].add(t[0])
    msg = m.RunOp(ident, result, t[0], tuple([r._wire_id() for r in refs]), stream.id)
    ctrl.send(msg, mesh.targets, stream.id, what)
    return result, ident


def _names_of(func) -> tuple:
    names = _names.get(id(func))
    if names is None:
        names = _names[id(func)] = (func.name(), op_name(func), func)
    return names


def _output(spec, base, ref_id: int, ident: int, mesh, stream, tensors: list):
    if spec is None:
        mesh._controller.delete_ref(ref_id)
        return None
    if type(spec) is int:  # in place: the input itself, naming the op's value from now on
        t = tensors[spec]
        if t._borrow is None and t.stream.id == stream.id:
            t._rebind(ref_id, ident)
            if t._aliases is not None:
                _rename_aliases(t, mesh, stream)
        else:
            mesh._controller.delete_ref(ref_id)
        return t
    out = Tensor(spec, ref_id, mesh, stream, ident)
    if base is not None:
        _join(out, tensors[base])
    return out


def _join(view: Tensor, base: Tensor) -> None:
    """``view`` shares ``base``'s storage on every rank: one alias group."""
    group = base._aliases
    if group is None:
        group = base._aliases = [weakref.ref(base)]
    elif len(group) >= 16:
        group[:] = [r for r in group if r() is not None]
    group.append(weakref.ref(view))
    view._aliases = group


def _rename_aliases(t: Tensor, mesh, stream) -> None:
    """After an in-place op on ``t``, every live tensor sharing its storage names
    its value anew, after that op: a failure of the op reaches their readers too
    (as the reference's ``mutates`` marks every alias)."""
    live = []
    for r in t._aliases:
        u = r()
        if u is None:
            continue
        live.append(r)
        if u is not t and u.mesh.targets == mesh.targets and u.generation == t.generation:
            _rename(u, t, mesh, stream)
    t._aliases[:] = live


def _rename(u: Tensor, after, mesh, stream) -> None:
    """``u`` names its value anew, once ``after`` (an op that wrote its storage) ran."""
    if u._deleted or u._borrow is not None or u.stream.id != stream.id:
        return
    rid, rident = _run(
        mesh._controller,
        ("alias",),
        lambda op: m.DefineOp(op, _ALIAS, (OpSlot(0), OpSlot(1)), {}, "alias"),
        (u, after),
        {},
        (u, after),
        mesh,
        stream,
        "alias",
    )
    u._rebind(rid, rident)


class _Holder:
    """The worker-side tuple of a multi-output op, named in the getitem calls."""

    __slots__ = ("id",)

    def __init__(self, ref_id: int):
        self.id = ref_id

    def _wire_id(self) -> int:
        return self.id

    def __reduce_ex__(self, protocol):
        return ref_placeholder(self.id)


def _is_mesh(x) -> bool:
    return isinstance(x, Tensor)


register_ref_type(_Holder, operator.attrgetter("id"))
