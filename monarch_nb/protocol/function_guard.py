"""Whether a function pickled by value would pickle the same again.

A function defined in a notebook goes to the workers by value, and cloudpickle
scans every loaded module for each module the function uses (about 1 ms a call
once torch is loaded). A ``FunctionGuard`` notes everything that pickle read:
the function's code, defaults, closure cells and attributes, and each global
its code names (present or not), recursively through the notebook functions it
calls. While all of those are the same objects, and no module was imported
since, the pickle made with the guard is the one a new pickle would give.

Only values whose pickle follows from their identity are guarded: modules,
importable functions and classes, numbers, strings, and tuples of those. A
function reading a list, a dict, a tensor or a notebook class is pickled per
call, as before, so that the workers always see the values of the moment.
"""

from __future__ import annotations

import dis
import sys
import types
import weakref
from operator import is_

from .messages import Function
from .pickling import function_ref, is_by_value

_MISSING = object()
_ATOMS = frozenset(
    {
        type(None),
        bool,
        int,
        float,
        complex,
        str,
        bytes,
        type(Ellipsis),
        types.ModuleType,
        types.BuiltinFunctionType,
    }
)


class _Unstable(Exception):
    """A value whose pickle may change while it stays the same object."""


# the instructions that name a global (the *_NAME ones: a class body's, inside a function)
_GLOBAL_OPS = frozenset(
    dis.opmap[op]
    for op in (
        "LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_NAME", "STORE_NAME", "DELETE_NAME"
    )
)


_names_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # code -> its globals


def _names(code: types.CodeType) -> tuple:
    """The globals ``code`` (and the code nested in it) names, sorted, as cloudpickle
    finds them: an attribute named like a notebook's variable (``batch.model``) is
    none. Kept per code object (as cloudpickle keeps its own): reading the
    instructions costs ~0.1 ms, and a function that reads a list is guarded anew
    at each call."""
    names = _names_of.get(code)
    if names is None:
        found = {i.argval for i in dis.get_instructions(code) if i.opcode in _GLOBAL_OPS}
        for c in code.co_consts:
            if type(c) is types.CodeType:
                found.update(_names(c))
        names = _names_of[code] = tuple(sorted(found))
    return names


def _state(fn: types.FunctionType) -> tuple:
    """The function's own parts that its pickle holds (compared by identity)."""
    cells = fn.__closure__
    contents = () if cells is None else tuple([c.cell_contents for c in cells])
    kw = fn.__kwdefaults__  # its names and values: a dict may change in place
    keywords = () if not kw else tuple([x for item in kw.items() for x in item])
    return (
        fn.__code__,
        fn.__defaults__,
        fn.__kwdefaults__,
        fn.__name__,
        fn.__qualname__,
        fn.__module__,
        fn.__doc__,
        fn.__annotations__,
        len(fn.__dict__),
        *keywords,
        *contents,
    )


_GONE = object()  # a weakly held value that died: never what a namespace holds


def _held(value) -> tuple:
    """What a guard keeps of ``value``: a weak reference where it takes one (a cached
    function must not keep itself, or a function it replaced, alive), else the value."""
    if type(value) in _ATOMS and type(value) is not types.ModuleType:
        return (False, value)
    try:
        return (True, weakref.ref(value))
    except TypeError:
        return (False, value)


def _value_of(held: tuple):
    weak, v = held
    if not weak:
        return v
    v = v()
    return _GONE if v is None else v


class FunctionGuard:
    """What a by-value function's pickle read; ``holds()`` while it is all unchanged."""

    def __init__(self):
        self._modules = len(sys.modules)
        # (namespace, name, _held(value or _MISSING)); (_held(function), _state)
        self._globals: list[tuple[dict, str, tuple]] = []
        self._functions: list[tuple[tuple, tuple]] = []
        self._seen: set[int] = set()

    @classmethod
    def of(cls, fn) -> FunctionGuard | None:
        """A guard of ``fn``'s pickle, or None when it reads a value that may change
        in place (then it must be pickled per call)."""
        if type(fn) is not types.FunctionType:
            return None
        guard = cls()
        try:
            guard._function(fn)
        except (_Unstable, ValueError):  # ValueError: an empty closure cell
            return None
        del guard._seen
        return guard

    def holds(self) -> bool:
        """Whether a new pickle of the function would be the guarded one."""
        if len(sys.modules) != self._modules:
            return False
        for namespace, name, held in self._globals:
            if namespace.get(name, _MISSING) is not _value_of(held):
                return False
        for held, state in self._functions:
            fn = _value_of(held)
            if fn is _GONE:
                return False
            now = _state(fn)
            if len(now) != len(state) or not all(map(is_, now, state)):  # at C speed
                return False
        return True

    def _function(self, fn: types.FunctionType) -> None:
        if id(fn) in self._seen:  # recursion: a function that calls itself
            return
        self._seen.add(id(fn))
        if fn.__dict__:
            raise _Unstable("attributes")
        state = _state(fn)
        self._functions.append((_held(fn), state))
        for value in (state[1], *state[9:]):  # defaults, keyword defaults, closure cells
            self._value(value)
        for value in fn.__annotations__.values():
            self._value(value)
        namespace = fn.__globals__
        for name in _names(fn.__code__):
            value = namespace.get(name, _MISSING)
            self._globals.append((namespace, name, _held(value)))
            if value is not _MISSING:
                self._value(value)

    def _value(self, value) -> None:
        tp = type(value)
        if tp in _ATOMS:
            return
        if tp is tuple or tp is frozenset:
            for v in value:
                self._value(v)
            return
        if isinstance(value, (types.FunctionType, type)) and not is_by_value(value):
            return  # pickled by its name
        if tp is types.FunctionType:
            self._function(value)  # a notebook function it calls: guarded likewise
            return
        raise _Unstable(tp.__name__)


_by_function: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # fn -> (Function, guard)
_builtins: dict[int, tuple] = {}  # id(fn) -> (fn, (Function, None)): torch.ones and the like


def pickled(fn, cached: tuple | None) -> tuple[Function, tuple | None]:
    """``(Function, cache)``: ``fn`` described for the workers (``function_ref``), or
    the Function in ``cached`` (the cache this returned last; else what the last call
    for ``fn`` made, so that ``mnb.remote(f)(x)`` in a loop pickles ``f`` once) while
    a new pickle would give the same. An importable function's is kept for good."""
    tp = type(fn)
    if cached is None:
        if tp is types.FunctionType:
            cached = _by_function.get(fn)
        elif tp is types.BuiltinFunctionType:
            held = _builtins.get(id(fn))
            cached = held[1] if held is not None and held[0] is fn else None
    if cached is not None and (cached[1] is None or cached[1].holds()):
        return cached[0], cached
    by_value = is_by_value(fn)
    guard = FunctionGuard.of(fn) if by_value else None
    f = function_ref(fn)  # after the guard: a change meanwhile fails it
    entry = (f, guard) if guard is not None or not by_value else None
    if tp is types.FunctionType:
        if entry is None:
            _by_function.pop(fn, None)
        else:
            _by_function[fn] = entry
    elif tp is types.BuiltinFunctionType and entry is not None and len(_builtins) < 4096:
        _builtins[id(fn)] = (fn, entry)
    return f, entry
