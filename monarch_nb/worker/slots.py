"""Arguments with holes: ``OpSlot(key)`` marks where a value goes, filled per call.

A tensor op's template (``OpSlot(i)``: the i-th Ref of an op in a RunOps) and a recorded
command (``OpSlot(ref id)``: that value of the replay) use the same walk.
"""

from __future__ import annotations

from ..protocol.aten import OpSlot
from .ref_cell import DependentOnError


def slot_keys(obj, out: set) -> set:
    """The keys of every slot in ``obj`` (tuples, lists, dicts walked), added to ``out``."""
    t = type(obj)
    if t is OpSlot:
        out.add(obj.i)
    elif t in (tuple, list):
        for o in obj:
            slot_keys(o, out)
    elif t is dict:
        for v in obj.values():
            slot_keys(v, out)
    return out


def fill(obj, values):
    """``obj`` with each slot replaced by ``values[key]`` (a value that is a failed
    one's DependentOnError is raised: the call depends on it)."""
    t = type(obj)
    if t is OpSlot:
        v = values[obj.i]
        if isinstance(v, DependentOnError):
            raise v
        return v
    if t is tuple:
        return tuple(fill(o, values) for o in obj)
    if t is list:
        return [fill(o, values) for o in obj]
    if t is dict:
        return {k: fill(v, values) for k, v in obj.items()}
    return obj
