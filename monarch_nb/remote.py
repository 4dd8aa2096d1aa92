"""Remote functions and Refs: values that live on the workers until fetched."""

from __future__ import annotations

import functools
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from .protocol import messages as m
from .protocol.wire import RefUseError, function_ref, is_by_value, pack_args, register_ref_type

if TYPE_CHECKING:
    from .mesh import DeviceMesh, Stream


class Ref:
    """A value on every rank of a mesh, produced on one stream.

    ``fetch()`` brings it back; ``del ref`` (or ``ref.delete()``) frees it on the
    workers. Passing a Ref to a remote function uses the value on each rank.
    """

    __slots__ = ("id", "ident", "mesh", "stream", "generation", "_deleted", "__weakref__")

    def __init__(self, ref_id: int, mesh: DeviceMesh, stream: Stream, ident: int):
        self.id = ref_id
        self.ident = ident  # the command that produces it
        self.mesh = mesh
        self.stream = stream
        self.generation = mesh._controller.generation
        self._deleted = False

    def __repr__(self) -> str:
        state = " deleted" if self._deleted else ""
        return f"<Ref {self.id} on {self.mesh.name!r} stream {self.stream.name!r}{state}>"

    def _check(self) -> None:
        if self._deleted:
            raise RefUseError(f"Ref {self.id} was deleted")
        ctrl = self.mesh._controller
        if self.generation != ctrl.generation:
            raise RefUseError(
                f"Ref {self.id} belongs to generation {self.generation} of mesh "
                f"{self.mesh.name!r}, which was restarted (now generation {ctrl.generation})"
            )

    def _wire_id(self) -> int:
        self._check()
        return self.id

    def fetch_async(self, rank: int | None = None) -> Future:
        """A Future of the value on ``rank``, or of the list of per-rank values."""
        self._check()
        mesh = self.mesh
        ctrl = mesh._controller
        ctrl.check_usable()
        ranks = mesh.targets if rank is None else (mesh._global_rank(rank),)
        args, _ = pack_args((self,), {})
        ident = ctrl.next_ident()
        fut = ctrl.expect(
            ident, ranks, single=rank is not None, what=f"fetch of Ref {self.id}", source=self.ident
        )
        ctrl.send(m.SendValue(ident, None, args, self.stream.id), ranks, self.stream.id, "fetch")
        return fut

    def fetch(self, rank: int | None = None, timeout: float | None = None) -> Any:
        """The value on ``rank`` (blocking), or the list of per-rank values in rank order."""
        fut = self.fetch_async(rank)
        return self.mesh._controller.wait_result(fut, timeout)

    def delete(self) -> None:
        """Free the value on the workers now."""
        if not self._deleted:
            self._deleted = True
            ctrl = self.mesh._controller
            if self.generation == ctrl.generation:
                ctrl.delete_ref(self.id)

    def __del__(self):
        try:
            self.delete()
        except Exception:
            pass


register_ref_type(Ref, Ref._wire_id)


def check_refs(refs: list, mesh: DeviceMesh, stream: Stream) -> None:
    """Refs passed to a command must live on its mesh and stream."""
    for r in refs:
        if r.mesh._controller is not mesh._controller:
            raise RefUseError(
                f"Ref {r.id} lives on mesh {r.mesh.name!r}, not on mesh {mesh.name!r}: "
                f"copy it with ref.to_mesh(...)"
            )
        if r.stream.id != stream.id:
            raise RefUseError(
                f"Ref {r.id} was produced on stream {r.stream.name!r}; to use it on stream "
                f"{stream.name!r}, borrow it: ref.borrow(stream)"
            )
        if r.mesh.targets != mesh.targets and not set(mesh.targets) <= set(r.mesh.targets):
            raise RefUseError(
                f"Ref {r.id} has values on ranks {r.mesh.ranks} only; the call runs on {mesh.ranks}"
            )


class RemoteFunction:
    """A function that runs on the workers: calling it returns a Ref at once."""

    def __init__(self, fn):
        if not callable(fn):
            raise TypeError(f"remote() needs a callable, got {type(fn).__name__}")
        self._fn = fn
        self._cached = None
        functools.update_wrapper(self, fn, updated=())

    def _function(self) -> m.Function:
        if self._cached is not None:
            return self._cached
        f = function_ref(self._fn)
        if not is_by_value(self._fn):
            self._cached = f  # by-value functions are pickled per call: their globals may change
        return f

    def __call__(
        self, *args, mesh: DeviceMesh | None = None, stream: Stream | None = None, **kwargs
    ) -> Ref:
        from .mesh import resolve_target

        mesh, stream = resolve_target(mesh, stream)
        ctrl = mesh._controller
        ctrl.check_usable()
        packed, refs = pack_args(args, kwargs) if (args or kwargs) else (None, ())
        if refs:
            check_refs(refs, mesh, stream)
        function = self._function()
        result = ctrl.next_id()
        ident = ctrl.next_ident()
        ctrl.send(
            m.CallFunction(ident, result, function, packed, stream.id, mesh.id, function.name),
            mesh.targets,
            stream.id,
            function.name,
        )
        return Ref(result, mesh, stream, ident)

    def __repr__(self) -> str:
        return f"<remote {getattr(self._fn, '__qualname__', self._fn)!r}>"


def remote(fn=None):
    """``remote(torch.ones)`` or ``@remote`` on a def: calls run on the workers.

    Call with ``mesh=`` and ``stream=`` keywords to choose where (default: the
    active mesh and stream); every other argument goes to the function. Refs
    among the arguments (at any depth) become their per-rank values.
    """
    if fn is None:
        return RemoteFunction
    if isinstance(fn, RemoteFunction):
        return fn
    return RemoteFunction(fn)
