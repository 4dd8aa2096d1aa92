"""Cells: the worker-side slots that Refs name."""

from __future__ import annotations

import sys


class DependentOnError(Exception):
    """Reading a value whose computation failed (in command ``ident``).

    Commands that read such a value fail silently with the same error: the
    controller already has the original failure.
    """

    def __init__(self, ident: int):
        super().__init__(ident)
        self.ident = ident

    def __str__(self) -> str:
        return f"depends on failed command {self.ident}"


_UNDEFINED = object()


class Cell:
    """Holds one value of the worker's env, or the DependentOnError it failed with."""

    __slots__ = ("value",)

    def __init__(self, value=_UNDEFINED):
        self.value = value

    def set(self, value) -> None:
        self.value = value

    def get(self):
        v = self.value
        if v is _UNDEFINED:
            raise RuntimeError("value read before it was defined")
        if type(v) is DependentOnError:
            raise v
        return v

    def __repr__(self) -> str:
        return "<Cell>"


class MissingRef(Exception):
    def __init__(self, rid: int):
        super().__init__(f"Ref {rid} is not defined on this worker (it was deleted)")


def get_value(cell: Cell):
    v = cell.value
    if isinstance(v, MissingRef):
        raise v
    return cell.get()


def raw(cell: Cell):
    """A cell's value, or the DependentOnError it holds (collectives take part either way)."""
    v = cell.value
    if isinstance(v, MissingRef):
        raise v
    return v


AUTOGRAD = "monarch_nb.protocol.autograd"  # the functions that build a rank's graph


def without_graph(resolve):
    """``resolve`` (a ref id -> its value) giving a shard that requires grad (the graph
    the tensor engine builds on each rank) detached: a user's function or namespace
    sees the values, and may write them in place, as it always could."""
    torch = sys.modules.get("torch")
    if torch is None:
        return resolve
    tensor = torch.Tensor

    def get(rid):
        v = resolve(rid)
        return v.detach() if isinstance(v, tensor) and v.requires_grad else v

    return get
