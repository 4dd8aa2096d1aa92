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


def storages(values) -> set:
    """The storages (their ids) of the tensors among ``values``."""
    torch = sys.modules.get("torch")
    if torch is None:
        return set()
    return {v.untyped_storage()._cdata for v in values if isinstance(v, torch.Tensor)}


def shares(value, keys: set) -> bool:
    """Whether ``value`` is a tensor of one of the storages ``keys``."""
    torch = sys.modules.get("torch")
    return (
        torch is not None
        and isinstance(value, torch.Tensor)
        and value.untyped_storage()._cdata in keys
    )


class Written:
    """A result of an op that writes ``cells``' values without returning them (a
    foreach op's lists): when the op fails, those cells fail too, and every cell of
    ``env`` holding a tensor of the same storage (their views); when it succeeds,
    nothing changes."""

    __slots__ = ("cells", "env")

    def __init__(self, cells: list, env: dict):
        self.cells, self.env = cells, env

    def set(self, value) -> None:
        if not isinstance(value, DependentOnError):
            return
        if type(value) is not DependentOnError:  # what a cell holds is read by its type
            value = DependentOnError(value.ident)
        keys = storages([c.value for c in self.cells])
        for c in self.cells:
            c.set(value)
        if keys:
            for c in list(self.env.values()):
                if shares(c.value, keys):
                    c.set(value)


def fail_written(inputs: list, values: dict, env: dict) -> None:
    """After a replay: each input ``(rid, cell)`` whose value in ``values`` became a
    failure there (an op that failed wrote it) fails in ``cell`` too, with every cell
    of ``env`` holding a tensor of its storage."""
    failed = [(c, values.get(rid)) for rid, c in inputs]
    failed = [
        (c, v)
        for c, v in failed
        if isinstance(v, DependentOnError) and not isinstance(c.value, (DependentOnError, MissingRef))
    ]
    if failed:
        Written([c for c, _ in failed], env).set(failed[0][1])


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
