"""``mnb.remote(fn, propagate=...)``: a remote function that returns mesh tensors.

The layout of the result comes from ``propagate``: a function given fake
inputs (FakeTensors of the mesh tensors' layouts) returning fake outputs;
``"inspect"``: read from the first rank after every call; ``"cached"`` (the
default for a function without a propagator called with mesh tensors): read
like that the first time per input-metadata key, then remembered. A result
that is no tensor (nor a tuple or list of tensors) stays a plain Ref.

Each call runs ``protocol.aten.call_checked`` on the workers (the dashboard
shows the function's own name), which compares
the result with the layout the controller used, so a wrong propagator fails
the value (a ``LayoutMismatchError`` at its first inspect or fetch).
"""

from __future__ import annotations

import sys
import weakref

from torch.utils._pytree import tree_leaves

from ...protocol import aten
from ...protocol.wire import function_ref
from ..context import recording_trace, resolve_target
from ..remote import TENSOR_ENGINE, remote
from .mode import active_mesh
from .plans import key_of
from .propagate import fake_inputs, layout_of
from .tensor import Tensor
from .values import outputs

_CALL = function_ref(aten.call_checked)
_describe = remote(aten.describe)
# fn -> {(propagate kind, argument key): description}; a redefined function starts anew
_layouts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CACHE_MAX = 4096


def _is_mesh(x) -> bool:
    return isinstance(x, Tensor)


def takes(args: tuple, kwargs: dict) -> bool:
    """Whether a mesh tensor is among the arguments (or in a list/tuple of them)."""
    for x in (*args, *kwargs.values()):
        if isinstance(x, Tensor):
            return True
        if type(x) in (list, tuple) and any(isinstance(y, Tensor) for y in x):
            return True
    return False


def _fake_describe(propagate, args: tuple, kwargs: dict, tensors: list, name: str):
    """The description of ``propagate``'s result on fake inputs (the mesh's mode off,
    inside ``mesh.activate()`` too); its failure is an error naming ``name``."""
    try:
        with fake_inputs(args, kwargs, tensors, _is_mesh) as (fargs, fkwargs, _):
            out = propagate(*fargs, **fkwargs)
            desc = aten.describe(out)
    except RecursionError:
        raise RuntimeError(
            f"the propagator of {name} recursed without end (on fake inputs of the "
            f"arguments' layouts)"
        ) from None
    except Exception as e:
        raise RuntimeError(f"the propagator of {name} raised {type(e).__name__}: {e}") from e
    if desc[0] == "value":
        raise TypeError(
            f"the propagator of {name} returned {type(out).__name__}: it must return "
            f"the fake outputs, a tensor or a tuple/list of tensors"
        )
    return desc


def _cache_of(fn) -> dict:
    try:
        cache = _layouts.get(fn)
        if cache is None:
            cache = _layouts[fn] = {}
    except TypeError:  # not weak-referenceable (a builtin): no cache
        return {}
    if len(cache) > _CACHE_MAX:
        cache.clear()
    return cache


def call(rf, args: tuple, kwargs: dict, mesh, stream):
    """Call remote function ``rf`` on ``mesh`` / ``stream`` (None: the active
    mesh, else the first mesh tensor's, else the default); mesh tensors out."""
    fn, propagate = rf._fn, rf._propagate or "cached"
    tensors: list = []
    local: list = []
    key = (
        propagate,  # the object, not its id: a collected lambda's id is reused
        key_of(tuple(args), tensors, local),
        key_of(tuple(kwargs.items()), tensors, local),
        *[t._layout for t in tensors],
        *[layout_of(t) for t in local],
    )
    if propagate == "inspect":
        key = None
    seen = {id(t) for t in tensors}
    for x in tree_leaves((tuple(args), dict(kwargs))):  # those in dicts, which key_of skips
        if isinstance(x, Tensor) and id(x) not in seen:
            seen.add(id(x))
            tensors.append(x)
    if mesh is None and stream is None and tensors and active_mesh() is None:
        mesh = tensors[0].mesh  # outside a mesh block: where the inputs live, as ops do
    mesh, stream = resolve_target(mesh, stream)
    cache = _cache_of(fn)
    try:
        desc = cache.get(key) if key is not None else None
    except TypeError:  # an unhashable argument: no cache
        key, desc = None, None
    if desc is None and callable(propagate):
        desc = _fake_describe(propagate, args, kwargs, tensors, getattr(fn, "__name__", "fn"))
        if key is not None:
            cache[key] = desc
    if desc is None and recording_trace.active is not None:
        raise RuntimeError(
            f"{getattr(fn, '__name__', 'fn')} inside mnb.compile: the layout of its result "
            f"must be known without asking the workers; give it a propagator: "
            f"mnb.remote(fn, propagate=lambda *fake_args: fake_result)"
        )
    target = rf._function()  # importable: pickled once for the life of rf
    ref = rf._send((target, desc, *args), kwargs, mesh, stream, _CALL._replace(name=target.name))
    if desc is None:  # "inspect", or "cached" the first time: ask the first rank
        try:
            desc = _describe._send((ref,), {}, mesh, stream).fetch(rank=mesh.targets[0])
        except BaseException:
            ref.delete()
            raise
        if key is not None and propagate == "cached":
            cache[key] = desc
    return outputs(ref, desc, mesh, stream)


TENSOR_ENGINE.install(sys.modules[__name__])  # mnb.remote calls with mesh tensors come here
