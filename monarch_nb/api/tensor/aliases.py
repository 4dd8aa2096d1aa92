"""Alias groups of mesh tensors: the tensors that share storage on every rank,
and the renames that make a failing in-place op reach every one of them."""

from __future__ import annotations

import operator
import weakref

from ...protocol.aten import OpSlot, alias_after, aliases_after
from ...protocol.pickling import ref_placeholder
from ...protocol.wire import function_ref, register_ref_type
from .send import aux_template, define, run
from .tensor import Tensor

_ALIAS = function_ref(alias_after)
_HOLDER = "an op's worker-side tuple goes to the workers as an argument only"
_ALIASES = function_ref(aliases_after)


class _Group(list):
    """Weak references to the live tensors sharing one storage. It is their weakrefs'
    callback too: once one tensor is left, it leaves the group, so a tensor whose
    aliases are gone is weakly referenced by nothing (``torch.utils.swap_tensors``,
    which ``Module.to()`` uses for such a subclass, refuses a tensor that is)."""

    __slots__ = ()

    def __call__(self, _dead=None) -> None:
        """Keep the live ones (a member died, or a writer looks)."""
        live = [r for r in self if r() is not None]
        if len(live) == 1:
            last = live[0]()
            if last is not None and last._aliases is self:
                last._aliases = None
            live = []
        self[:] = live


def join(view: Tensor, base: Tensor) -> None:
    """``view`` shares ``base``'s storage on every rank: one alias group."""
    group = base._aliases
    if group is not None and len(group) >= 16:
        group()
        group = base._aliases
    if group is None:
        group = base._aliases = _Group()
        group.append(weakref.ref(base, group))
    group.append(weakref.ref(view, group))
    view._aliases = group


def leave(t: Tensor) -> None:
    """``t`` no longer shares its group's storage (``t.data = x`` gave it another)."""
    group = t._aliases
    if group is not None:
        group[:] = [r for r in group if r() is not t]
        t._aliases = None
        group()


def rename_aliases(t: Tensor, mesh, stream) -> None:
    """After an in-place op on ``t``, every live tensor sharing its storage names
    its value anew, after that op: a failure of the op reaches their readers too
    (as the reference's ``mutates`` marks every alias)."""
    group = t._aliases
    group()
    for r in list(group):
        u = r()
        if u is not None and u is not t:
            if u.mesh.targets == mesh.targets and u.generation == t.generation:
                _rename(u, t, mesh, stream)


def rename_written(written: list, after, mesh, stream) -> None:
    """Every tensor of ``written`` (an op wrote them without returning them: a foreach
    op's lists), and every live tensor sharing storage with one, names its value anew
    once ``after`` ran, so a failure of that op reaches their readers: one command
    for all of them (``aliases_after``; an entry whose result is a tuple of ids)."""
    names, seen = [], set()
    for t in written:
        group = [t]
        shared = t._aliases
        if shared is not None:
            shared()
            group += [u for u in (r() for r in shared) if u is not None]
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
    op = define(ctrl, aux_template(("aliases", n), slots, _ALIASES, "alias"))
    ident, ids = ctrl.next_ident(), tuple([ctrl.next_id() for _ in names])
    refs = (after._wire_id(), *[u._wire_id() for u in names])
    ctrl.send_op((ident, ids, op, refs, stream.id, ()), mesh.targets, "alias")
    for u, rid in zip(names, ids):
        u._rebind(rid, ident)


def _rename(u: Tensor, after, mesh, stream) -> None:
    """``u`` names its value anew, once ``after`` (an op that wrote its storage) ran."""
    if u._deleted or u._borrow is not None or u.stream.id != stream.id:
        return
    rid, rident = run(
        mesh._controller,
        aux_template(("alias",), (OpSlot(0), OpSlot(1)), _ALIAS, "alias"),
        (u, after),
        {},
        (u, after),
        mesh,
        stream,
        "alias",
    )
    u._rebind(rid, rident)


class Holder:
    """The worker-side tuple of a multi-output op, named in the getitem calls."""

    __slots__ = ("id",)
    _deleted, generation = False, None  # as a Ref's (``send._ids``): never stale

    def __init__(self, ref_id: int):
        self.id = ref_id

    def _check(self) -> None:
        pass

    def _wire_id(self) -> int:
        return self.id

    def __reduce_ex__(self, protocol):
        return ref_placeholder(self.id, (_HOLDER,) * 2)


register_ref_type(Holder, operator.attrgetter("id"))
