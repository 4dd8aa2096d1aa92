"""One aten op on mesh tensors -> one command on the mesh.

The op's output layouts come from ``propagate`` once per key (``plans``): a
repeated op costs a key, a dict lookup and a ``RunOp`` of its template (an op id
and the ref ids), which every worker set learns once per generation.
"""

from __future__ import annotations

import operator
import sys
import weakref

import torch

from ...protocol import messages as m
from ...protocol.aten import OpSlot, alias_after, aliases_after
from ...protocol.pickling import pack_ref_args, ref_placeholder
from ...protocol.wire import RefUseError, function_ref, pack_args, register_ref_type
from ..context import resolve_target
from ..remote import check_refs
from . import borrows, from_data
from .plans import RUN_OP, Plan, key_of, lifts_floats, lookup, next_op_id, plan
from .propagate import DataDependentError, layout_of, op_name
from .tensor import DISPATCH, Tensor

_GETITEM = function_ref(operator.getitem)
_ALIAS = function_ref(alias_after)
_ALIASES = function_ref(aliases_after)
_LIFTS = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}
_COPY = torch.ops.aten.copy_.default  # a local source goes by value (load_state_dict)
_CUDA = torch.device("cuda")
_aux: dict = {}  # the templates of the dispatcher's own ops (an output of many, an alias)
_defined: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # ctrl -> (gen, {op id})
_last = [lambda: None, -1, set()]  # the controller sent to last: weakref, generation, op ids


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
    floats = [] if lifts_floats(func) else None
    # id(func): OpOverloads live as long as torch, and their __hash__ is Python code
    kw = key_of(tuple(kwargs.items()), tensors, local, floats) if kwargs else ()
    key = (id(func), key_of(args, tensors, local, floats), kw)
    if not tensors and mesh is not None and kwargs.get("device") is not None:
        # a factory: torch fills in the CPU default; a CUDA mesh's default is its GPU
        if _device_type(kwargs["device"]) == "cpu" and mesh.device_type == "cuda":
            kwargs = dict(kwargs, device=_CUDA)
            floats = [] if floats is not None else None
            kw = key_of(tuple(kwargs.items()), tensors, local, floats)
            key = (id(func), key_of(args, [], [], floats), kw)
    if tensors:
        key += tuple([t._layout for t in tensors])
    if mesh is None:
        if not tensors:
            raise RuntimeError(f"{op_name(func)}: no mesh tensor among its arguments")
        mesh = tensors[0].mesh
    if local:
        return _with_local(func, args, kwargs, mesh, tensors, local, key)
    p = lookup(key)
    if p is None:
        if from_data.known(key):
            return from_data.run(func, args, kwargs, tensors, mesh)
        try:
            p = plan(func, args, kwargs, tensors, key, floats is not None)
        except DataDependentError:
            from_data.remember(key)
            return from_data.run(func, args, kwargs, tensors, mesh)
    if p.cuda:  # the plan may have been made on another mesh
        p.check_device(mesh)
    mesh, stream, ctrl = _target(p, tensors, mesh)
    result, ident = _run(
        ctrl, p.template, (p.qualname, *args), kwargs, tensors, mesh, stream, p.what, floats
    )
    return _finish(p, result, ident, func, args, kwargs, tensors, mesh, stream)


def _with_local(func, args, kwargs, mesh, tensors: list, local: list, key):
    """An op with local tensors among its arguments: ``torch.tensor(data)`` (the data
    goes to every rank), local torch (no mesh tensor), or 0-dim values beside mesh
    tensors (sent by value, as CPU scalars go with CUDA tensors)."""
    to_gpu = False
    if func in _LIFTS:
        if local[0].dim() == 0:  # torch.tensor(0.0): a host scalar, as torch.optim wants
            return func(*args, **kwargs)
        p = Plan(func, ("one", layout_of(local[0]), None), (), (), _names(func), None)
        to_gpu = mesh.device_type == "cuda"  # ... and onto each rank's GPU
    elif not tensors:  # local tensors only (an inspected shard, its repr): local torch
        return func(*args, **kwargs)
    else:
        copy_in = func is _COPY and args[0] is tensors[0] and len(args) > 1 and args[1] is local[0]
        for t in local:
            if (t.dim() != 0 and not copy_in) or t.requires_grad:
                raise _local_error(op_name(func), t, mesh)
        p = lookup(key) or plan(func, args, kwargs, tensors, key)
        p.check_device(mesh)
    mesh, stream, ctrl = _target(p, tensors, mesh)
    packed, _ = pack_args((p.qualname, *args), kwargs)
    result, ident = ctrl.next_id(), ctrl.next_ident()
    msg = m.CallFunction(ident, result, RUN_OP, packed, stream.id, mesh.id, p.what)
    ctrl.send(msg, mesh.targets, stream.id, p.what)
    out = _finish(p, result, ident, func, args, kwargs, tensors, mesh, stream)
    if to_gpu:
        return dispatch(torch.ops.aten._to_copy.default, (out,), {"device": _CUDA})
    return out


def _target(p: Plan, tensors: list, mesh) -> tuple:
    """``(mesh, stream, controller)`` the op runs on, its tensors checked against them
    (their mesh and stream, the borrows live) and the ranks usable."""
    mesh, stream = resolve_target(mesh, None)
    if tensors:
        check_refs(tensors, mesh, stream)
        if borrows.live[0]:
            borrows.check(p.what, tensors, p.written)
    ctrl = mesh._controller
    ctrl.check_usable(mesh.targets)
    return mesh, stream, ctrl


def _names(func) -> tuple:
    return (func.name(), op_name(func))


def _finish(p: Plan, result: int, ident: int, func, args, kwargs, tensors, mesh, stream):
    """The op's outputs, once its command is sent: mesh tensors naming its values."""
    ctrl = mesh._controller
    if p.mutated:  # before the op's own value may be freed below
        _rename_written([tensors[j] for j in p.mutated], _Holder(result), mesh, stream)
    entry = p.entry
    kind = entry[0]
    if kind == "one":
        return _output(entry[1], entry[2], result, ident, mesh, stream, tensors)
    if kind == "relayout":
        _relayout(tensors[entry[1]], func, args, kwargs, entry[2])
        return _output(entry[1], None, result, ident, mesh, stream, tensors)
    if kind == "value":
        ctrl.delete_ref(result)
        return entry[1]
    outs = []
    what = p.what
    for i, (spec, base) in enumerate(zip(entry[2], entry[3])):
        if spec is None:
            outs.append(None)
            continue
        held = (_Holder(result),)
        rid, rident = _run(
            ctrl,
            _aux_template(("getitem", i, what), (OpSlot(0), i), _GETITEM, what),
            (held[0], i),
            {},
            held,
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


def _device_type(device) -> str:
    return device.type if isinstance(device, torch.device) else torch.device(device).type


def _run(ctrl, template, args, kwargs, refs, mesh, stream, what: str, floats=None) -> tuple:
    """Send one op: a RunOps entry of ``template`` (``(op id, DefineOp)``, defined on every
    worker first) with ``floats`` for its scalar slots (``mnb.compile`` records it as
    such), or, without a template (an unhashable key), a CallFunction of its arguments.
    Returns (result id, ident)."""
    result, ident = ctrl.next_id(), ctrl.next_ident()
    if template is None:
        function = RUN_OP
        packed = pack_ref_args(args, kwargs, tuple([r.id for r in refs]))
        msg = m.CallFunction(ident, result, function, packed, stream.id, mesh.id, what)
        ctrl.send(msg, mesh.targets, stream.id, what)
        return result, ident
    op = _define(ctrl, template)
    refs = tuple([r._wire_id() for r in refs])
    scalars = tuple(floats) if floats else ()
    ctrl.send_op((ident, result, op, refs, stream.id, scalars), mesh.targets, what)  # checked
    return result, ident


def _define(ctrl, template: tuple) -> int:
    """The op id of ``template``, defined on ``ctrl``'s workers first if need be."""
    op = template[0]
    known = _known(ctrl)
    if op not in known:
        ctrl.send(template[1], None)
        known.add(op)
    return op


def _known(ctrl) -> set:
    """The op ids the workers of ``ctrl``'s current generation have been sent."""
    last = _last
    gen = ctrl.generation
    if last[0]() is ctrl and last[1] == gen:
        return last[2]
    seen = _defined.get(ctrl)
    if seen is None or seen[0] != gen:
        seen = _defined[ctrl] = (gen, set())
    last[:] = [weakref.ref(ctrl), gen, seen[1]]
    return seen[1]


def _aux_template(key: tuple, skeleton: tuple, function, what: str) -> tuple:
    """The template of one of the dispatcher's own ops, made once."""
    t = _aux.get(key)
    if t is None:
        op = next_op_id()
        t = _aux[key] = (op, m.DefineOp(op, function, skeleton, {}, what))
    return t


def _output(spec, base, ref_id: int, ident: int, mesh, stream, tensors: list):
    if spec is None:
        mesh._controller.delete_ref(ref_id)
        return None
    if type(spec) is int:  # in place: the input itself, naming the op's value from now on
        t = tensors[spec]
        if t._borrow is None and t.stream.id == stream.id:
            t._rebind(ref_id, ident)
            if t._aliases is not None:
                rename_aliases(t, mesh, stream)
        else:
            mesh._controller.delete_ref(ref_id)
        return t
    if base is None:
        return Tensor(spec, ref_id, mesh, stream, ident)
    if torch.is_inference_mode_enabled() and not tensors[base].is_inference():
        # a view of a normal tensor is a normal tensor, in inference mode too (autograd
        # then shares the base's version counter, which an inference tensor has not)
        with torch.inference_mode(False):
            out = Tensor(spec, ref_id, mesh, stream, ident)
    else:
        out = Tensor(spec, ref_id, mesh, stream, ident)
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


def rename_aliases(t: Tensor, mesh, stream) -> None:
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


def _rename_written(written: list, after, mesh, stream) -> None:
    """Every tensor of ``written`` (an op wrote them without returning them: a foreach
    op's lists), and every live tensor sharing storage with one, names its value anew
    once ``after`` ran, so a failure of that op reaches their readers: one command
    for all of them (``aliases_after``; an entry whose result is a tuple of ids)."""
    names, seen = [], set()
    for t in written:
        group = [t]
        if t._aliases is not None:
            pairs = [(r, r()) for r in t._aliases]
            t._aliases[:] = [r for r, u in pairs if u is not None]
            group += [u for _, u in pairs if u is not None]
        for u in group:
            if id(u) in seen or u._deleted or u._borrow is not None or u.stream.id != stream.id:
                continue
            if u is t or (u.mesh.targets == mesh.targets and u.generation == t.generation):
                seen.add(id(u))
                names.append(u)
    if not names:
        return
    ctrl, n = mesh._controller, len(names)
    slots = tuple(OpSlot(i) for i in range(n + 1))
    op = _define(ctrl, _aux_template(("aliases", n), slots, _ALIASES, "alias"))
    ident, ids = ctrl.next_ident(), tuple([ctrl.next_id() for _ in names])
    refs = (after._wire_id(), *[u._wire_id() for u in names])
    ctrl.send_op((ident, ids, op, refs, stream.id, ()), mesh.targets, "alias")
    for u, rid in zip(names, ids):
        u._rebind(rid, ident)


def _rename(u: Tensor, after, mesh, stream) -> None:
    """``u`` names its value anew, once ``after`` (an op that wrote its storage) ran."""
    if u._deleted or u._borrow is not None or u.stream.id != stream.id:
        return
    rid, rident = _run(
        mesh._controller,
        _aux_template(("alias",), (OpSlot(0), OpSlot(1)), _ALIAS, "alias"),
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


register_ref_type(_Holder, operator.attrgetter("id"))

DISPATCH.install(sys.modules[__name__])  # mesh tensors' __torch_dispatch__ comes here
