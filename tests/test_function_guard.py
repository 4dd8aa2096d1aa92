"""A notebook's remote function is pickled once, and again as soon as anything its
pickle read changes: unit tests of ``FunctionGuard`` on functions defined as a
notebook defines them (in ``__main__``), and the workers seeing each change."""

from __future__ import annotations

import gc
import importlib
import sys
import textwrap
import weakref

import pytest
import torch

import monarch_nb as mnb
from monarch_nb.protocol.function_guard import FunctionGuard, pickled

CELL = """
import math
SCALE = 2
TABLE = [1, 2]

def helper(x):
    return x * SCALE

def f(x, k=1):
    return helper(x) + k + math.floor(0.5)

def g(x):
    return x + TABLE[0]

def fact(n):
    return 1 if n <= 1 else n * fact(n - 1)

def typed(x: int) -> int:
    return x + LATER

def attrs(batch):
    return batch.TABLE  # an attribute, not the notebook's list

def outer(v):
    def inner(x):
        return x + v
    def bump(w):
        nonlocal v
        v = w
    return inner, bump
"""


def _notebook() -> dict:
    """A namespace as a notebook kernel has it: functions in it pickle by value."""
    ns = {"__name__": "__main__"}
    exec(compile(textwrap.dedent(CELL), "<cell 1>", "exec"), ns)
    return ns


@pytest.mark.unit
def test_guard_holds_until_a_global_it_reads_is_rebound():
    ns = _notebook()
    guard = FunctionGuard.of(ns["f"])
    assert guard is not None and guard.holds() and guard.holds()
    ns["UNRELATED"] = 1
    assert guard.holds()
    ns["SCALE"] = 3  # read by helper, which f calls
    assert not guard.holds()


@pytest.mark.unit
def test_guard_fails_when_a_helper_is_redefined_or_the_function_changes():
    ns = _notebook()
    guard = FunctionGuard.of(ns["f"])
    exec("def helper(x):\n    return -x\n", ns)
    assert not guard.holds()

    guard = FunctionGuard.of(ns["f"])
    ns["f"].__defaults__ = (5,)
    assert not guard.holds()

    guard = FunctionGuard.of(ns["f"])
    ns["f"].__code__ = ns["g"].__code__
    assert not guard.holds()


@pytest.mark.unit
def test_a_name_defined_later_and_a_new_import_fail_the_guard():
    ns = _notebook()
    guard = FunctionGuard.of(ns["typed"])  # reads LATER, not defined yet
    assert guard is not None and guard.holds()
    ns["LATER"] = 1
    assert not guard.holds()

    guard = FunctionGuard.of(ns["typed"])
    name = "monarch_nb_guard_probe"
    sys.modules.pop(name, None)
    spec = importlib.machinery.ModuleSpec(name, None)
    sys.modules[name] = importlib.util.module_from_spec(spec)
    try:
        assert not guard.holds()  # a submodule the code names may have come in
    finally:
        del sys.modules[name]


@pytest.mark.unit
def test_closure_cells_recursion_and_values_that_change_in_place():
    ns = _notebook()
    inner, bump = ns["outer"](1)
    guard = FunctionGuard.of(inner)
    assert guard.holds()
    bump(2)
    assert not guard.holds()

    assert FunctionGuard.of(ns["fact"]).holds()  # calls itself
    assert FunctionGuard.of(ns["attrs"]).holds()  # .TABLE reads no global
    assert FunctionGuard.of(ns["g"]) is None  # reads a list: pickled per call
    exec("def kw(*, k=1):\n    return k\n", ns)
    guard = FunctionGuard.of(ns["kw"])
    ns["kw"].__kwdefaults__["k"] = 2  # changed in place
    assert not guard.holds()
    empty, _ = ns["outer"]({})  # a closure over a dict, empty or not: pickled per call
    assert FunctionGuard.of(empty) is None
    ns["f"].note = "x"
    assert FunctionGuard.of(ns["f"]) is None  # attributes: pickled per call
    assert FunctionGuard.of(print) is None


def test_workers_see_every_change_of_a_notebook_function(mesh):
    ns = _notebook()
    f, g = mnb.remote(ns["f"]), mnb.remote(ns["g"])
    assert f(10, mesh=mesh).fetch() == [21, 21]
    first = f._function()
    assert f._function() is first  # nothing changed: the same pickle
    ns["SCALE"] = 3
    assert f(10, mesh=mesh).fetch() == [31, 31]
    assert f._function() is not first

    assert g(1, mesh=mesh).fetch() == [2, 2]
    ns["TABLE"][0] = 100  # changed in place: g is pickled per call
    assert g(1, mesh=mesh).fetch() == [101, 101]

    inner, bump = ns["outer"](1)
    h = mnb.remote(inner)
    assert h(1, mesh=mesh).fetch() == [2, 2]
    bump(5)
    assert h(1, mesh=mesh).fetch() == [6, 6]


def test_a_remote_made_per_call_reuses_the_pickle_and_sees_changes(mesh):
    ns = _notebook()
    assert mnb.remote(ns["f"])(1, mesh=mesh).fetch() == [3, 3]  # mnb.remote(f)(x) in a loop
    assert mnb.remote(ns["f"])._function() is mnb.remote(ns["f"])._function()
    ns["SCALE"] = 5
    assert mnb.remote(ns["f"])(1, mesh=mesh).fetch() == [6, 6]
    ones = mnb.remote(torch.ones)
    assert ones._function() is mnb.remote(torch.ones)._function()  # a builtin, by name


@pytest.mark.unit
def test_the_cache_keeps_no_redefined_function_alive():
    ns = _notebook()
    old = weakref.ref(ns["fact"])  # it names itself: its guard reads it
    pickled(ns["fact"], None)
    exec("def fact(n):\n    return 2\n", ns)
    gc.collect()
    assert old() is None
