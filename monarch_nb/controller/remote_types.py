"""The remote exception's own type, here: a RemoteError for a remote ``ValueError`` is
also a ``ValueError`` (so ``except ValueError:`` around a fetch catches it) when the
type can be found on the controller and be combined with RemoteError.

The combined class is made once per remote type and never calls the remote type's
``__init__`` or ``__new__``: the remote exception object itself is not sent, only
its type's name, module and qualname, its message and traceback text.
"""

from __future__ import annotations

import sys
import threading
import types

# remote type -> (combined class or None, why not); made on the IO thread or the caller's
_combined: dict[type, tuple[type | None, str]] = {}
_lock = threading.Lock()


def type_path(module: str, qualname: str) -> str:
    """``builtins``/``__main__`` types by their qualname alone, others dotted."""
    return qualname if module in ("builtins", "__main__", "") else f"{module}.{qualname}"


def find_type(name: str, module: str, qualname: str) -> tuple[type | None, str]:
    """The class ``module.qualname`` if its module is loaded here (it is never
    imported for this: an ``except`` clause naming the type has loaded it)."""
    path = type_path(module, qualname)
    if not module or not qualname:
        return None, ""
    if "<" in qualname:  # <locals>: a class made inside a function, not reachable by name
        return None, f"{path} is a local class"
    obj = sys.modules.get(module)
    if obj is None:
        return None, f"module {module!r} is not imported here"
    try:
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except Exception:
        return None, f"{path} is not defined here"
    if not (isinstance(obj, type) and issubclass(obj, BaseException) and obj.__name__ == name):
        return None, f"{path} is not an exception class here"
    return obj, ""


def combined_class(base: type, remote: type) -> tuple[type | None, str]:
    """A class deriving from ``base`` (RemoteError) and ``remote``, or None and why not."""
    with _lock:
        got = _combined.get(remote)
        if got is None:
            got = _combined[remote] = _combine(base, remote)
        return got


def _combine(base: type, remote: type) -> tuple[type | None, str]:
    if not issubclass(remote, Exception):
        return None, f"{remote.__name__} derives from BaseException only"
    if issubclass(remote, base):
        return None, f"{remote.__name__} is a RemoteError already"
    for k in remote.__mro__:
        new = vars(k).get("__new__")
        if new is not None and not isinstance(new, types.BuiltinFunctionType):
            return None, f"{k.__qualname__} defines __new__"
    name = f"{base.__name__}({remote.__qualname__})"
    try:
        cls = types.new_class(name, (base, remote), {})
    except Exception as e:  # layout conflicts, final types, metaclasses, __init_subclass__
        return None, f"cannot derive from {remote.__qualname__}: {type(e).__name__}: {e}"
    try:
        super(base, cls).__new__(cls)  # as RemoteError.__new__ will make one
    except Exception as e:  # a C __new__ that wants arguments (ExceptionGroup)
        return None, f"{remote.__qualname__}.__new__ needs its arguments ({e})"
    cls.__qualname__ = name
    cls.__module__ = base.__module__
    cls.__doc__ = f"A {base.__name__} that is also the remote {remote.__qualname__}."
    cls.remote_type = remote
    return cls, ""
