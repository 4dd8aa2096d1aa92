"""Sending one tensor op: a RunOps entry of its template (``(op id, DefineOp)``),
which the workers of each generation are sent once, or a CallFunction where the
op has no template."""

from __future__ import annotations

import weakref

from ...protocol import messages as m
from ...protocol.autograd import run_op_grad, tensors_in
from ...protocol.pickling import pack_ref_args
from ...protocol.wire import function_ref
from .plans import RUN_OP, next_op_id

_RUN_OP_GRAD = function_ref(run_op_grad)
_aux: dict = {}  # the templates of the dispatcher's own ops (an output of many, an alias)
_defined: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # ctrl -> (gen, {op id})
_last = [lambda: None, -1, set()]  # the controller sent to last: weakref, generation, op ids


def run(
    ctrl, template, args, kwargs, refs, mesh, stream, what: str, floats=None, grad=None, outputs=0
):
    """Send one op: a RunOps entry of ``template`` (``(op id, DefineOp)``, defined on every
    worker first) with ``floats`` for its scalar slots (``mnb.compile`` records it as
    such), or, without a template (an unhashable key), a CallFunction of its arguments
    (with autograd when ``grad``). Returns (result id, ident); the result is a tuple of
    ``outputs`` ids (one per item of the op's value) for a template's op with outputs."""
    result, ident = ctrl.next_id(), ctrl.next_ident()
    if template is None:
        function, args = call_of(args[0], args[1:], kwargs, grad is not None)
        packed = pack_ref_args(args, kwargs, tuple([r.id for r in refs]))
        msg = m.CallFunction(ident, result, function, packed, stream.id, mesh.id, what)
        ctrl.send(msg, mesh.targets, stream.id, what)
        return result, ident
    op = define(ctrl, template)
    if outputs:
        result = (result, *[ctrl.next_id() for _ in range(outputs - 1)])
    refs = _ids(refs, ctrl.generation)
    scalars = tuple(floats) if floats else ()
    ctrl.send_op((ident, result, op, refs, stream.id, scalars), mesh.targets, what)  # checked
    return result, ident


def _ids(refs, generation: int) -> tuple:
    """The ids of ``refs``, each checked as ``Ref._wire_id`` checks it (a loop of
    attribute reads: a foreach op sends tens)."""
    ids = []
    for r in refs:
        if r._deleted or r.generation != generation:
            r._check()  # raises why
        ids.append(r.id)
    return tuple(ids)


def call_of(qualname: str, args: tuple, kwargs: dict, grad: bool) -> tuple:
    """``(function, args)`` of a CallFunction running an op: ``run_op`` (without
    autograd), or with ``grad`` ``run_op_grad`` and the places of the tensors that
    require grad."""
    if grad:
        where = tuple([i for i, t in enumerate(tensors_in(args, kwargs)) if t.requires_grad])
        return _RUN_OP_GRAD, (where, qualname, *args)
    return RUN_OP, (qualname, *args)


def define(ctrl, template: tuple) -> int:
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


def aux_template(key: tuple, skeleton: tuple, function, what: str) -> tuple:
    """The template of one of the dispatcher's own ops, made once."""
    t = _aux.get(key)
    if t is None:
        op = next_op_id()
        t = _aux[key] = (op, m.DefineOp(op, function, skeleton, {}, what))
    return t
