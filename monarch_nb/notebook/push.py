"""Which notebook names a ``%%monarch`` cell takes along to the workers.

Automatically: every name the cell's code reads that is, in the notebook, a
function or class defined in the notebook itself (``__main__``), or a
``mnb.remote`` wrapper of one (the plain function goes). They travel by value
(cloudpickle, with their real source lines) and are bound in each worker's
namespace just before the cell runs, so a helper defined in an ordinary cell
can be called in a ``%%monarch`` cell. Explicitly: ``--push a,b`` sends any
notebook values (data, Refs: a Ref becomes its value on each rank).

An automatic name never replaces a worker variable that worker code defined
(a ``%%monarch`` cell's own ``model = ...`` wins over a notebook ``def model``);
``--push`` always binds. A name that cannot be pickled is left out with a note
on stderr.
"""

from __future__ import annotations

import ast
import sys
import types

from IPython.core.error import UsageError

from ..api.remote import RemoteFunction
from ..protocol.wire import is_by_value, pack_args


def names_read(source: str) -> set[str]:
    """Names the code loads (anywhere, nested functions included)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _notebook_defined(obj):
    """The object to send for a notebook-defined function or class, else None."""
    if isinstance(obj, RemoteFunction):
        obj = obj._fn
    if isinstance(obj, (types.FunctionType, type)) and is_by_value(obj):
        module = getattr(obj, "__module__", None)
        if module == "__main__" or (module or "").startswith("__ipython"):
            return obj
    return None


def _picklable(value) -> str | None:
    try:
        pack_args((), {"v": value})
    except Exception as e:  # noqa: BLE001 - reported to the user
        return str(e)
    return None


def names_to_push(source: str, user_ns: dict, explicit: list[str] | None) -> tuple[dict, dict]:
    """The names (and values) to bind on the workers before ``source`` runs:
    ``(explicit, automatic)``."""
    out: dict = {}
    auto: dict = {}
    for name in sorted(names_read(source)):
        if name not in user_ns:
            continue
        obj = _notebook_defined(user_ns[name])
        if obj is None:
            continue
        problem = _picklable(obj)
        if problem is not None:
            print(
                f"%%monarch: not sending notebook name {name!r} to the workers ({problem})",
                file=sys.stderr,
            )
            continue
        auto[name] = obj
    for name in explicit or ():
        if name not in user_ns:
            raise UsageError(f"%%monarch: --push {name!r}: no such variable in the notebook")
        value = user_ns[name]
        if isinstance(value, RemoteFunction):
            value = value._fn
        problem = _picklable(value)
        if problem is not None:
            raise UsageError(f"%%monarch: --push {name!r}: {problem}")
        out[name] = value
        auto.pop(name, None)
    return out, auto
