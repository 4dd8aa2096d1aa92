"""Functions pickled by an importable name that holds a wrapper of them, or that they
wrap (``functools.wraps``): by that name and the number of ``__wrapped__`` steps."""

from __future__ import annotations

import sys


def reduce_wrapped(fn):
    """A function whose importable name holds a wrapper of it, or which wraps the
    function of its name (functools.wraps; torch._dynamo wraps torch.manual_seed,
    the tensor engine torch.random.manual_seed): by that name and the number of
    ``__wrapped__`` steps from it to ``fn``. Otherwise NotImplemented (pickle's way)."""
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    qualname = getattr(fn, "__qualname__", "")
    if module is None or "<" in qualname:
        return NotImplemented
    named = module
    for part in qualname.split("."):
        named = getattr(named, part, None)
    if named is None or named is fn:
        return NotImplemented
    found, depth = named, 0
    while found is not fn and found is not None and depth < 8:
        found, depth = getattr(found, "__wrapped__", None), depth + 1
    if found is not fn:  # fn wraps the named function: calling that is the same
        inner, depth = fn, 0
        while inner is not named and inner is not None and depth < 8:
            inner, depth = getattr(inner, "__wrapped__", None), depth + 1
        if inner is not named:
            return NotImplemented
        depth = 0
    return (_load_wrapped, (module.__name__, qualname, depth))


def _load_wrapped(module: str, qualname: str, depth: int):
    import importlib

    fn = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    for _ in range(depth):  # where the name holds no wrapper, it is the function itself
        fn = getattr(fn, "__wrapped__", fn)
    return fn
