"""What the dispatcher knows of an aten op once it has seen it: its ``Plan``.

A call's *key* holds the op, every argument (each mesh tensor as a mark of its
place, so that two uses of one tensor stay one), the other arguments with
their types, and the layouts of the mesh tensors. The first call of a key runs
FakeTensor propagation and builds the plan; every later call of that key costs
the key and one dict lookup.

The Python floats of a pointwise or foreach op cannot change its outputs'
layouts: they are *lifted*, kept out of the key as a mark and sent with each
call into scalar slots of the template (an optimizer's learning rate and bias
corrections change every step; they must not cost a propagation each).
"""

from __future__ import annotations

import itertools
import pickle

import torch

from ...protocol import messages as m
from ...protocol.aten import OpSlot, run_op, wire_name
from ...protocol.wire import RefUseError, function_ref
from .propagate import op_name, propagate
from .tensor import Tensor

RUN_OP = function_ref(run_op)
_MARK = object()
_marks = [(_MARK, i) for i in range(64)]
_LOCAL = object()
_FLOAT = object()  # a lifted float's place in a key
_lifting: dict = {}  # id(op) -> whether its floats are lifted
_SCALARS = (float, bool, complex)
_RUN = object()  # in a key: a run of mesh tensors of a long list, by their places
_FLOATS = object()  # in a key: a long list of lifted floats, by its length
_ONLY_TENSORS, _ONLY_FLOATS = {Tensor}, {float}
_LONG = 8  # a list longer than this is keyed by ids (a foreach op's: tens of tensors)
_plans: dict = {}
_templates: dict = {}  # a template's pickled arguments -> (op id, DefineOp)
_PLANS_MAX = 100_000
_default_dtype = torch.get_default_dtype
_planned = [torch.get_default_dtype()]  # the default dtype the plans were made under
_op_ids = itertools.count(1)  # a template's id, unique in this process


class Plan:
    """A repeated op: its output description (``propagate``'s), the inputs it writes
    without returning them (``mutated``: a foreach op's lists), every input it
    writes (``written``), its names, and its template ``(op id, DefineOp)``
    (None for a call whose key is unhashable)."""

    __slots__ = (
        "entry", "mutated", "written", "qualname", "what", "template", "func", "cuda", "outputs"
    )

    def __init__(self, func, entry, mutated: tuple, written: tuple, names: tuple, template):
        self.func = func  # kept alive: the key holds its id
        self.entry = entry
        self.mutated = mutated
        self.written = written
        self.qualname, self.what = names
        self.template = template
        self.cuda = _makes_cuda(entry)  # checked against each mesh it runs on
        self.outputs = len(entry[2]) if entry[0] == "many" else 0  # items of its value

    def check_device(self, mesh) -> None:
        """A CUDA result on a mesh without GPUs is refused at the call."""
        if self.cuda and mesh.device_type != "cuda":
            raise RefUseError(
                f"{self.what} makes a CUDA tensor, but the workers of mesh {mesh.name!r} "
                f"have no GPUs (its tensors live on the CPU): leave them on the mesh's device"
            )


def next_op_id() -> int:
    return next(_op_ids)


def lifts_floats(func) -> bool:
    """Whether ``func``'s float arguments go to scalar slots (a pointwise or foreach
    op: their values cannot change a layout), not into the key."""
    lift = _lifting.get(id(func))
    if lift is None:
        lift = _lifting[id(func)] = torch.Tag.pointwise in func.tags or func.__name__.startswith(
            "_foreach_"
        )
    return lift


def key_of(x, tensors: list, local: list, floats: list | None = None):
    """A hashable stand-in for an argument; collects mesh tensors and local ones,
    and (with ``floats``, for an op that lifts them) Python floats."""
    tp = type(x)
    if tp is int or tp is str or x is None:
        return x
    if tp is float and floats is not None:
        floats.append(x)
        return _FLOAT
    if tp is Tensor:
        for i, y in enumerate(tensors):
            if y is x:
                return _marks[i] if i < 64 else (_MARK, i)
        i = len(tensors)
        tensors.append(x)
        return _marks[i] if i < 64 else (_MARK, i)
    if tp is list or tp is tuple:  # sizes, dims: ints mostly, taken here without a call
        if len(x) > _LONG:
            return _long_key(x, tensors, local, floats)
        return tuple(
            [y if type(y) is int or y is None else key_of(y, tensors, local, floats) for y in x]
        )
    if tp in _SCALARS:  # 1.0 == 1 == True, but they promote differently
        return (tp, x)
    if isinstance(x, torch.Tensor):
        if isinstance(x, Tensor):  # a subclass of ours
            tensors.append(x)
            return (_MARK, len(tensors) - 1)
        local.append(x)
        return (_LOCAL, len(local) - 1, x.dtype, x.dim())
    return x


def _long_key(x, tensors: list, local: list, floats: list | None) -> tuple:
    """``key_of`` of a long list (a foreach op's tensors): each tensor's place found
    by its id, not by a scan of those met before. A list of mesh tensors met for the
    first time, each once, or the same run of them again (``addcmul_(a, g, g)``), is
    one mark of that run; a list of floats an op lifts, one mark of their count."""
    types = set(map(type, x))
    if types == _ONLY_FLOATS and floats is not None:  # an optimizer's per-tensor floats
        floats.extend(x)
        return (_FLOATS, len(x))
    where = dict(zip(map(id, tensors), itertools.count()))
    if types == _ONLY_TENSORS:
        ids = list(map(id, x))
        n = len(ids)
        if where.keys().isdisjoint(ids) and len(set(ids)) == n:
            start = len(tensors)
            tensors.extend(x)
            return (_RUN, start, n)
        start = where.get(ids[0])
        if start is not None and list(map(id, tensors[start : start + n])) == ids:
            return (_RUN, start, n)
    out = []
    for y in x:
        if type(y) is Tensor:
            i = where.get(id(y))
            if i is None:
                i = where[id(y)] = len(tensors)
                tensors.append(y)
            out.append(_marks[i] if i < 64 else (_MARK, i))
        elif type(y) is int or y is None:
            out.append(y)
        else:
            n = len(tensors)
            out.append(key_of(y, tensors, local, floats))
            for j in range(n, len(tensors)):
                where.setdefault(id(tensors[j]), j)
    return tuple(out)


def lookup(key):
    """The plan of ``key``, or None (also for an unhashable key). Plans made under
    another default dtype than torch's now are dropped first (``defaults.py``)."""
    if _default_dtype() is not _planned[0]:
        _planned[0] = _default_dtype()
        _plans.clear()
    try:
        return _plans.get(key)
    except TypeError:
        return None


def plan(func, args, kwargs, tensors: list, key, lifted: bool = False, grad=None) -> Plan:
    """Propagate ``func`` once and keep its plan under ``key`` (unless None or
    unhashable); ``lifted``: its floats go to scalar slots after the tensors' slots,
    in the order ``key_of`` met them (kwargs first); ``grad``: the places of the
    tensors that require grad (it runs with autograd on the ranks), or None."""
    entry = propagate(func, args, kwargs, tensors, _is_mesh)
    mutated = _mutated_inputs(func, args, kwargs, tensors, entry)
    names = (wire_name(func), op_name(func))
    try:
        hash(key)
    except TypeError:
        key = None
    written = _written(entry, mutated)
    template = None
    if key is not None:
        index = {id(t): i for i, t in enumerate(tensors)}
        floats = [len(tensors)] if lifted else None  # the next scalar slot
        skel_kwargs = _skeleton(kwargs, index, floats)
        skel_args = (names[0], *_skeleton(args, index, floats))
        # the ranks fail what it writes when it fails, and the rest of their storages
        template = _template(skel_args, skel_kwargs, names[1], grad, written)
    p = Plan(func, entry, mutated, written, names, template)
    if key is not None:
        if len(_plans) >= _PLANS_MAX:
            _plans.clear()
            _templates.clear()
        _plans[key] = p
    return p


def _template(args: tuple, kwargs: dict, what: str, grad=None, writes: tuple = ()) -> tuple:
    """``(op id, DefineOp)`` of an op with these arguments: one per distinct content,
    so that plans which differ only in their inputs' layouts (a slice's storage
    offset) send the same op (``mnb.compile`` sees the same command)."""
    try:
        content = pickle.dumps((args, kwargs, grad, writes), 5)
    except Exception:
        content = None
    template = _templates.get(content) if content is not None else None
    if template is None:
        op = next_op_id()
        template = (op, m.DefineOp(op, RUN_OP, args, kwargs, what, grad, writes))
        if content is not None:
            _templates[content] = template
    return template


def _written(entry, mutated: tuple) -> tuple:
    """Indices of the input tensors an op writes (in place, ``out=``, or a foreach list)."""
    if entry[0] in ("one", "relayout"):
        return (entry[1], *mutated) if type(entry[1]) is int else mutated
    if entry[0] == "many":
        return (*[s for s in entry[2] if type(s) is int], *mutated)
    return mutated


def _makes_cuda(entry) -> bool:
    if entry[0] == "one":
        specs = [entry[1]]
    elif entry[0] == "many":
        specs = entry[2]
    else:
        return False
    return any(type(spec) is tuple and spec[4].type == "cuda" for spec in specs)


def written(func, args, kwargs):
    """The values of the arguments ``func`` writes (in place, or ``out=``), each list's
    members one by one."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return
    pos = 0
    for a in schema.arguments:
        if a.kwarg_only:
            v = kwargs.get(a.name)
        else:
            v = args[pos] if pos < len(args) else kwargs.get(a.name)
            pos += 1
        if a.alias_info is not None and a.alias_info.is_write:
            yield from v if isinstance(v, (list, tuple)) else (v,)


def _mutated_inputs(func, args, kwargs, tensors: list, entry) -> tuple:
    """Indices (in ``tensors``) of the inputs ``func`` writes without returning them."""
    if not tensors:
        return ()
    index = {id(t): i for i, t in enumerate(tensors)}
    found = [
        index[id(t)] for t in written(func, args, kwargs) if isinstance(t, Tensor) and id(t) in index
    ]
    returned = set()
    if entry[0] in ("one", "relayout") and type(entry[1]) is int:
        returned.add(entry[1])
    elif entry[0] == "many":
        returned.update(s for s in entry[2] if type(s) is int)
    return tuple(j for j in dict.fromkeys(found) if j not in returned)


def _skeleton(x, index: dict, floats: list | None):
    """``x`` with each mesh tensor replaced by the OpSlot of its place in ``index``
    and, with ``floats`` (``[next slot]``), each float by the next scalar slot."""
    tp = type(x)
    if tp is Tensor or isinstance(x, Tensor):
        return OpSlot(index[id(x)])
    if tp is float and floats is not None:
        floats[0] += 1
        return OpSlot(floats[0] - 1)
    if tp is list or tp is tuple:
        return tp(_skeleton(y, index, floats) for y in x)
    if tp is dict:
        return {k: _skeleton(v, index, floats) for k, v in x.items()}
    return x


def _is_mesh(x) -> bool:
    return isinstance(x, Tensor)
