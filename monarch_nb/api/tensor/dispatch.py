"""One aten op on mesh tensors -> one command on the mesh.

The op's output layouts come from ``propagate`` once per key (``plans``): a
repeated op costs a key, a dict lookup and a ``RunOp`` of its template (an op id
and the ref ids), which every worker set learns once per generation.
"""

from __future__ import annotations

import operator
import sys

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ...controller import PENDING_INTERRUPT, raise_pending_interrupt
from ...protocol import messages as m
from ...protocol.aten import OpSlot, wire_name
from ...protocol.autograd import saved_copy, tensors_in
from ...protocol.wire import RefUseError, function_ref, pack_args
from ..context import resolve_target
from ..remote import check_refs
from . import borrows, from_data
from .agreed import agreed_shard, leave_recording
from .aliases import Holder, join, rename_aliases, rename_written
from .defaults import follow
from .generators import draw, is_default_generator
from .plans import Plan, key_of, lifts_floats, lookup, plan, written
from .propagate import DataDependentError, layout_of, op_name
from .send import aux_template, call_of, run
from .tensor import DISPATCH, TRACING, Tensor

__all__ = ["dispatch", "rename_aliases", "target"]  # rename_aliases: DISPATCH's users

_GETITEM = function_ref(operator.getitem)
_GRAD = object()  # in a plan key: the places of the tensors that require grad follow
_grad_on = torch.is_grad_enabled
_LIFTS = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}
_COPY = torch.ops.aten.copy_.default  # a local source goes by value (load_state_dict)
_CUDA = torch.device("cuda")
_EMPTY = torch.ops.aten.empty_strided.default
_STACK = torch.ops.aten.stack.default
_DETACH = torch.ops.aten.detach.default
_PACK = torch.ops.aten._pack_padded_sequence.default
_INDEX = torch.ops.aten.index.Tensor
_SAVED = function_ref(saved_copy)
_AD_INPLACE_OR_VIEW = torch._C.DispatchKey.ADInplaceOrView
_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded


def _local_error(name: str, t: torch.Tensor, mesh) -> RefUseError:
    if t.dim() == 0 and t.requires_grad:
        return RefUseError(
            f"{name} mixes a local 0-dim tensor that requires grad with mesh tensors of mesh "
            f"{mesh.name!r}: torch.tensor(number) stays a local host scalar under the mesh, "
            f"and so does an nn.Parameter of one outside a module (one registered on a "
            f"module built under the mesh goes to the mesh): make it on the mesh with "
            f"torch.full((), x, requires_grad=True), or as a module's parameter"
        )
    return RefUseError(
        f"{name} mixes a local tensor (shape {tuple(t.shape)}, {t.dtype}) with mesh "
        f"tensors of mesh {mesh.name!r}: send its values to every rank with "
        f"mesh.tensor(x) (as x.to(device) moves a batch onto a GPU), or create it on the "
        f"mesh (factories and torch.tensor(data) inside 'with mesh.activate():' make mesh "
        f"tensors), or bring the mesh tensor's shard here with mnb.inspect(t) and compute "
        f"locally (inside 'with mnb.no_mesh():' factories are local too)"
    )


def dispatch(func, args, kwargs, mesh=None):
    """Run ``func`` on the shards of its mesh tensors (or, for a factory, on
    ``mesh``): returns mesh tensors with the layouts FakeTensor predicts."""
    if PENDING_INTERRUPT:  # a Ctrl-C a finalizer dropped: raised in the user's loop
        raise_pending_interrupt()
    if kwargs and kwargs.get("generator") is not None:
        if not is_default_generator(kwargs["generator"]):
            return _drawn_here(func, args, kwargs, mesh)
        # torch's default generator, named (random_split's default): under the mesh the
        # default is the ranks' own, which advance as it does locally
        kwargs = {**kwargs, "generator": None}
    if func is _DETACH:
        t = args[0]
        if (
            type(t) is Tensor
            and t._layout is not None
            and not _excluded(_AD_INPLACE_OR_VIEW)
            and not t.is_inference()
        ):
            # not a user's detach (that comes through autograd): torch's copy of an
            # op's output it saves or unpacks, which has the op's graph; on the ranks too.
            # (t.data comes here as well: harmless, as each later use is detached on the
            # ranks unless it requires grad here; only t.data.requires_grad_() differs)
            return _saved_copy(t)
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
    grad = None
    if tensors:
        layouts = tuple([t._layout for t in tensors])
        if None in layouts:  # torch.compile traces
            return TRACING.value.dispatch(func, args, kwargs)
        key += layouts
        if _grad_on():  # it runs with autograd on the ranks too (protocol/autograd.py)
            grad = tuple([i for i, t in enumerate(tensors) if t.requires_grad])
            key += (_GRAD, grad)
    if mesh is None:
        if not tensors:
            raise RuntimeError(f"{op_name(func)}: no mesh tensor among its arguments")
        mesh = tensors[0].mesh
    if func is _PACK:
        return _packed(*args, mesh)
    if local:
        return _with_local(func, args, kwargs, mesh, tensors, local, key)
    p = lookup(key)
    if p is None:
        if from_data.known(key):
            return from_data.run(func, args, kwargs, tensors, mesh, grad is not None)
        try:
            p = plan(func, args, kwargs, tensors, key, floats is not None, grad)
        except DataDependentError:
            from_data.remember(key)
            return from_data.run(func, args, kwargs, tensors, mesh, grad is not None)
    if p.cuda:  # the plan may have been made on another mesh
        p.check_device(mesh)
    mesh, stream, ctrl = target(tensors, mesh, p.what, p.written)
    result, ident = run(
        ctrl,
        p.template,
        (p.qualname, *args),
        kwargs,
        tensors,
        mesh,
        stream,
        p.what,
        floats,
        grad,
        p.outputs,
    )
    templated = p.template is not None
    return _finish(p, result, ident, func, args, kwargs, tensors, mesh, stream, templated)


def _drawn_here(func, args, kwargs, mesh):
    """A random op with a local ``generator=``: drawn here (``generators.draw``), its
    values copied to every rank."""
    value, t = draw(func, args, kwargs)
    if t is None:
        return sent(value, mesh) if isinstance(value, torch.Tensor) else value
    return dispatch(_COPY, (t, value), {})


def sent(value: torch.Tensor, mesh) -> Tensor:
    """A new mesh tensor of ``mesh`` holding local ``value`` on every rank (0-dim too,
    which ``torch.tensor(data)`` keeps here as a host scalar)."""
    layout = {"dtype": value.dtype, "device": value.device}
    empty = dispatch(_EMPTY, (value.shape, value.stride()), layout, mesh)
    return dispatch(_COPY, (empty, value), {})


def _packed(x, lengths, batch_first: bool, mesh) -> tuple:
    """``_pack_padded_sequence`` (``pack_padded_sequence``): its ``batch_sizes`` are made
    here from the lengths every rank agrees on, as torch's RNNs and
    ``pad_packed_sequence`` read them here; its data is gathered on the ranks in one op
    (a copy of the same values, as torch's)."""
    if isinstance(lengths, Tensor):
        lengths = agreed_shard(lengths, "pack_padded_sequence's lengths")
    with _disable_current_modes():
        if not isinstance(x, Tensor):
            return _PACK(x, lengths, batch_first)
        _, sizes = _PACK(torch.zeros(x.shape[:2]), lengths, batch_first)  # torch's checks
        counts = sizes.tolist()
        steps = torch.cat([torch.full((n,), t) for t, n in enumerate(counts)])
        rows = torch.cat([torch.arange(n) for n in counts])
    index = [rows, steps] if batch_first else [steps, rows]
    return dispatch(_INDEX, (x, [sent(i, x.mesh) for i in index]), {}), sizes


def _saved_copy(t: Tensor) -> Tensor:
    """torch's copy of a tensor autograd saves: on the ranks the tensor itself."""
    mesh, stream, ctrl = target([t], t.mesh, "detach", ())
    template = aux_template(("saved",), (OpSlot(0),), _SAVED, "detach")
    rid, ident = run(ctrl, template, (t,), {}, (t,), mesh, stream, "detach")
    return _output(t._layout, 0, rid, ident, mesh, stream, [t])


def local_only(func, args, kwargs) -> bool:
    """Whether an op that reaches the mesh's mode with no mesh tensor among its
    arguments reads local tensors: local torch (an optimizer's step counts, an
    inspected shard), run as such without a key or a plan. ``torch.tensor(data)``
    (a lift) and factories (no tensor at all) are no such op: they go to the mesh."""
    if func in _LIFTS:
        return False
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, torch.Tensor):
            return True
        if type(a) is list or type(a) is tuple:
            for b in a:
                if isinstance(b, torch.Tensor):
                    return True
    return False


def scalars_only(args, kwargs) -> bool:
    """Whether every tensor among an op's arguments is 0-dim (host scalars)."""
    return not any(t.dim() for t in tensors_in(args, kwargs))


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
        here = [
            t
            for t in written(func, args, kwargs)
            if isinstance(t, torch.Tensor) and not isinstance(t, Tensor)
        ]
        if here:  # the ranks would write a copy of it: each takes the ranks' value back
            return _written_here(func, args, kwargs, mesh, here)
        p = lookup(key) or plan(func, args, kwargs, tensors, key)
        p.check_device(mesh)
    mesh, stream, ctrl = target(tensors, mesh, p.what, p.written)
    function, call = call_of(p.qualname, args, kwargs, bool(tensors) and _grad_on())
    packed, _ = pack_args(call, kwargs)
    result, ident = ctrl.next_id(), ctrl.next_ident()
    msg = m.CallFunction(ident, result, function, packed, stream.id, mesh.id, p.what)
    ctrl.send(msg, mesh.targets, stream.id, p.what)
    out = _finish(p, result, ident, func, args, kwargs, tensors, mesh, stream, False)
    if to_gpu:
        return dispatch(torch.ops.aten._to_copy.default, (out,), {"device": _CUDA})
    return out


def _written_here(func, args, kwargs, mesh, here: list):
    """An op that writes host scalars (local 0-dim tensors) with mesh tensors' values
    (ASGD's foreach path copies its step sizes into its own): it runs on the ranks on
    mesh copies of them, and each takes back the value every rank agrees on, in one
    round trip (as ``t.item()`` asks)."""
    name = op_name(func)
    leave_recording(name)
    copies = {id(t): sent(t, mesh) for t in here}

    def mesh_copy(x):
        if type(x) is list or type(x) is tuple:
            return type(x)([copies.get(id(y), y) for y in x])
        return copies.get(id(x), x)

    out = dispatch(func, tuple(map(mesh_copy, args)), {k: mesh_copy(v) for k, v in kwargs.items()})
    values = [copies[id(t)] for t in here]
    if len({v.dtype for v in values}) == 1:  # one fetch for them all
        values = list(agreed_shard(dispatch(_STACK, (values,), {}), name))
    else:
        values = [agreed_shard(v, name) for v in values]
    back = {id(copies[id(t)]): t for t in here}
    for t, v in zip(here, values):
        t.copy_(v)
    if type(out) is list or type(out) is tuple:
        return type(out)([back.get(id(o), o) for o in out])
    return back.get(id(out), out)


def target(tensors: list, mesh, what: str, written: tuple) -> tuple:
    """``(mesh, stream, controller)`` a command named ``what`` runs on, its tensors
    checked against them (their mesh and stream; the live borrows, ``written`` the
    places of those it writes) and the ranks usable."""
    mesh, stream = resolve_target(mesh, None)
    if tensors:
        check_refs(tensors, mesh, stream)
        if borrows.live[0]:
            borrows.check(what, tensors, written)
    ctrl = mesh._controller
    ctrl.check_usable(mesh.targets)
    follow(ctrl, mesh, stream)  # the ranks' torch settings are this process's
    return mesh, stream, ctrl


def _names(func) -> tuple:
    return (wire_name(func), op_name(func))


def _finish(
    p: Plan, result: int, ident: int, func, args, kwargs, tensors, mesh, stream, templated=True
):
    """The op's outputs, once its command is sent: mesh tensors naming its values
    (``result``: a tuple of ids, one per item of a value of several, or one id;
    ``templated``: sent as a RunOps entry of ``p``'s template, not a CallFunction)."""
    ctrl = mesh._controller
    several = type(result) is tuple
    if p.mutated:
        if templated:  # the ranks fail what it writes when it fails (DefineOp.writes)
            for j in p.mutated:
                tensors[j].ident = ident
        else:  # a CallFunction: renamed after it (before its value may be freed below)
            after = Holder(result[0] if several else result)
            rename_written([tensors[j] for j in p.mutated], after, mesh, stream)
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
    if several:  # each item already has its id on the ranks
        specs = zip(entry[2], entry[3], result)
        return entry[1]([_output(s, b, rid, ident, mesh, stream, tensors) for s, b, rid in specs])
    outs = []  # a CallFunction's value: one getitem command per item
    what = p.what
    for i, (spec, base) in enumerate(zip(entry[2], entry[3])):
        if spec is None:
            outs.append(None)
            continue
        held = (Holder(result),)
        rid, rident = run(
            ctrl,
            aux_template(("getitem", i, what), (OpSlot(0), i), _GETITEM, what),
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
    join(out, tensors[base])
    return out


DISPATCH.install(sys.modules[__name__])  # mesh tensors' __torch_dispatch__ comes here
