"""Remote functions and Refs: values that live on the workers until fetched."""

from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING, Any

from ..controller import PENDING_INTERRUPT as _PENDING_INTERRUPT
from ..controller import AsyncResult, hand_back_interrupts, keep_unraisable_hook
from ..controller import raise_pending_interrupt as _raise_pending_interrupt
from ..hooks import Hook
from ..protocol import messages as m
from ..protocol.function_guard import pickled
from ..protocol.pickling import ref_placeholder
from ..protocol.reduce_options import REDUCTIONS, check_combination
from ..protocol.wire import (
    RefUseError,
    load_group,
    pack_args,
    register_ref_type,
    register_special_type,
)
from .context import BaseMesh, Stream, recording_trace, resolve_target

if TYPE_CHECKING:
    from .mesh import DeviceMesh

_REFUSALS = (
    "a Ref names a value on the ranks, which torch.save and pickle cannot save: bring it "
    "here first (ref.fetch())",
    "a function sent to the workers by value refers to a Ref (in its closure or globals): "
    "pass the Ref as an argument instead (mnb.remote(fn)(ref) gives fn each rank's value)",
)


class Ref:
    """A value on every rank of a mesh, produced on one stream.

    ``fetch()`` brings it back; ``del ref`` (or ``ref.delete()``) frees it on the
    workers. Passing a Ref to a remote function uses the value on each rank.
    """

    # no __slots__ here (with torch.Tensor's layout they would conflict): a mesh tensor
    # keeps these fields in slots of its own class. _deleted and _borrow are the
    # class's until set
    _fetched: m.Function | None = None  # what a fetch sends of the value (None: itself)
    _deleted = False
    _borrow: list | None = None  # [borrow id, first use sent]
    _refusals = _REFUSALS  # what a pickle other than the wire's is told (ref_placeholder)

    def __init__(self, ref_id: int, mesh: DeviceMesh, stream: Stream, ident: int):
        self.id = ref_id
        self.ident = ident  # the command that produces it
        self.mesh = mesh
        self.stream = stream
        self.generation = mesh._controller.generation
        keep_unraisable_hook()  # its __del__ hands a Ctrl-C back: see controller.sigint

    def __repr__(self) -> str:
        state = " deleted" if self._deleted else ""
        return f"<Ref {self.id} on {self.mesh.name!r} stream {self.stream.name!r}{state}>"

    def __reduce_ex__(self, protocol):
        # the wire's pickler sends Refs itself; any other pickle refuses (ref_placeholder)
        return ref_placeholder(self._wire_id(), self._refusals)

    def _check(self) -> None:
        if self._deleted:
            raise RefUseError(getattr(self, "_gone", None) or f"Ref {self.id} was deleted")
        ctrl = self.mesh._controller
        if self.generation != ctrl.generation:
            raise RefUseError(
                f"Ref {self.id} belongs to generation {self.generation} of mesh "
                f"{self.mesh.name!r}, which was restarted (now generation {ctrl.generation})"
            )

    def _wire_id(self) -> int:
        self._check()
        return self.id

    def fetch_async(self, rank: int | None = None, timeout: float | None = None) -> AsyncResult:
        """The AsyncResult of the value on ``rank``, or of the list of per-rank
        values (``await`` it, or ``.result()``). ``timeout``: a deadline in seconds,
        after which it fails with TimeoutError and the fetch is cancelled."""
        self._check()
        mesh = self.mesh
        ctrl = mesh._controller
        ctrl.check_usable(mesh.targets)
        self._first_use()
        ranks = mesh.targets if rank is None else (mesh._global_rank(rank),)
        args, _ = pack_args((self,), {})
        return ctrl.request(
            m.SendValue(ctrl.next_ident(), self._fetched, args, self.stream.id),
            ranks,
            f"fetch of Ref {self.id}",
            stream=self.stream.id,
            label="fetch",
            single=rank is not None,
            source=self.ident,
            timeout=timeout,
        )

    def fetch(self, rank: int | None = None, timeout: float | None = None) -> Any:
        """The value on ``rank`` (blocking), or the list of per-rank values in rank
        order. After ``timeout`` s: TimeoutError, and the fetch is cancelled."""
        return self.fetch_async(rank, timeout).result()

    def delete(self) -> None:
        """Free the value on the workers now (a borrow: give it back to its stream)."""
        if not self._deleted:
            self._deleted = True
            ctrl = self.mesh._controller
            if self.generation != ctrl.generation:
                return
            if self._borrow is None:
                ctrl.delete_ref(self.id)
            elif ctrl.usable:
                ctrl.send(m.BorrowDrop(self._borrow[0], self.id), self.mesh.targets, check=False)

    # ------------------------------------------------------------ communication

    def reduce(
        self,
        dims,
        reduction: str = "sum",
        scatter: bool = False,
        inplace: bool = False,
        out: Ref | None = None,
    ) -> Ref:
        """Reduce over mesh dims (a name or several) with torch.distributed, as
        the reference worker does. With n members in the group and input shape S:

        * "sum", "avg", "max", "min", "product": all_reduce, result shape S;
          ``scatter=True``: reduce_scatter, dim 0 of S must be n and member i
          gets the reduction of row i (shape S[1:]).
        * "stack": all_gather, shape (n, *S) (over several dims, one leading
          dim per reduced dim, in mesh order); ``scatter=True``: all_to_all,
          shape S, dim 0 split into n chunks, chunk j of member i's result
          being chunk i of member j's input.

        Members are in mesh order. ``inplace=True`` writes the result into this
        value (all_reduce and stack with scatter only: elsewhere the shape
        changes); ``out=`` into another Ref's tensor, which must have the
        result's dtype and shape on every rank; the two exclude each other.
        Impossible combinations raise ValueError here; shape errors arise on the
        workers, alike on every rank. If an input fails on some ranks, the
        result fails everywhere with that failure; an in-place all_reduce may
        then leave the others' inputs reduced over the ranks that did not fail
        (as the reference's stand-in zeros do). Stack and scatter over several
        dims go beyond the reference (which refuses them). On gloo, "avg" is a
        sum and a division; where gloo lacks all_gather_into_tensor or
        reduce_scatter_tensor they are composed from all_gather / all_reduce.
        Returns a new Ref on the same mesh and stream.
        """
        self._check()
        mesh, stream = self.mesh, self.stream
        names = list(mesh.dims)
        dims = (dims,) if isinstance(dims, str) else tuple(dims)
        if not dims:
            raise ValueError("reduce() needs at least one dim")
        for d in dims:
            if d not in names:
                raise ValueError(f"unknown dim {d!r}: mesh {mesh.name!r} has dims {names}")
        if reduction not in REDUCTIONS:
            raise ValueError(
                f"unknown reduction {reduction!r}: expected one of {', '.join(REDUCTIONS)}"
            )
        check_combination(reduction, scatter, inplace, out is not None)
        check_refs([self] if out is None else [self, out], mesh, stream)
        ctrl = mesh._controller
        ctrl.check_usable()
        self._first_use()
        reduced = tuple(sorted(names.index(d) for d in set(dims)))
        key = ctrl.process_group(mesh._slice, reduced, stream.id)
        ident, result = ctrl.next_ident(), ctrl.next_id()
        what = f"reduce {','.join(dims)} {reduction}{' scatter' if scatter else ''}"
        sizes = tuple(mesh._slice.sizes[i] for i in reduced)
        into = None if out is None else out.id
        msg = m.Reduce(
            ident, result, self.id, key, reduction, scatter, inplace, into, stream.id, sizes, what
        )
        ctrl.send(msg, mesh.targets, stream.id, what)
        return Ref(result, mesh, stream, ident)

    def to_mesh(self, other: DeviceMesh) -> Ref:
        """Copy to ``other`` rank by rank (i-th rank of this mesh to the i-th of
        ``other``) with batched isend/irecv; a rank copying to itself makes a
        copy-on-write clone. Returns a Ref on ``other``, same stream."""
        self._check()
        if not isinstance(other, BaseMesh):
            raise TypeError(f"to_mesh() needs a DeviceMesh, got {type(other).__name__}")
        mesh, stream = self.mesh, self.stream
        ctrl = mesh._controller
        if other._controller is not ctrl:
            raise RefUseError(
                f"Ref {self.id} lives on mesh {mesh.name!r}; mesh {other.name!r} is another world: fetch and send the value instead"
            )
        if other.size != mesh.size:
            raise ValueError(
                f"to_mesh() needs meshes of one size: {mesh.size} ranks -> {other.size} ranks"
            )
        ctrl.check_usable()
        self._first_use()
        root = ctrl.root_slice
        key = ctrl.process_group(root, tuple(range(len(root.sizes))), stream.id)
        pairs = tuple(zip(mesh.targets, other.targets))
        ident, result = ctrl.next_ident(), ctrl.next_id()
        targets = tuple(sorted(set(mesh.targets) | set(other.targets)))
        ctrl.send(
            m.SendTensor(ident, result, self.id, key, pairs, stream.id),
            targets,
            stream.id,
            "to_mesh",
        )
        return Ref(result, other, stream, ident)

    def borrow(self, stream: Stream) -> Ref:
        """This value for use on ``stream``. Its first use there waits for this
        stream to have produced it; until the borrow is dropped (``del``), this
        stream cannot free or mutate it under the borrower."""
        self._check()
        if not isinstance(stream, Stream) or stream.mesh._controller is not self.mesh._controller:
            raise TypeError("borrow() needs a stream of this Ref's mesh: mesh.stream(name)")
        if stream.id == self.stream.id:
            raise ValueError(f"Ref {self.id} is already on stream {stream.name!r}")
        ctrl = self.mesh._controller
        ctrl.check_usable(self.mesh.targets)
        self._first_use()
        borrow, result = ctrl.next_id(), ctrl.next_id()
        ctrl.send(
            m.BorrowCreate(borrow, self.id, self.stream.id, stream.id, result), self.mesh.targets
        )
        r = Ref(result, self.mesh, stream, self.ident)
        r._borrow = [borrow, False]
        return r

    def _first_use(self) -> None:
        b = self._borrow
        if b is not None and not b[1]:
            b[1] = True
            self.mesh._controller.send(m.BorrowFirstUse(b[0]), self.mesh.targets)

    def __del__(self):
        try:
            self.delete()
        except KeyboardInterrupt:  # a Ctrl-C landed here: free the value all the same
            self._deleted = False
            self.delete()
            raise  # a finalizer cannot raise it: controller.sigint hands it back
        except Exception:
            pass


register_ref_type(Ref, Ref._wire_id)
hand_back_interrupts()  # Ref.__del__ runs in every loop of tensor ops
_packing = threading.local()  # .stream: the stream of the call whose arguments are pickled


class ProcessGroup:
    """``mesh.process_group(dims)``: passed to a remote function, it arrives as the
    real torch.distributed group over those dims for the stream the call runs on."""

    def __init__(self, mesh: DeviceMesh, dims: tuple):
        self.mesh = mesh
        self.dims = dims
        names = list(mesh.dims)
        self._reduced = tuple(sorted(names.index(d) for d in dims))

    def _reduce(self):
        stream = getattr(_packing, "stream", None)
        if stream is None:
            raise RefUseError(
                "a process group can only be passed as an argument of a remote function"
            )
        if stream.mesh._controller is not self.mesh._controller:
            raise RefUseError(f"this process group belongs to mesh {self.mesh.name!r}")
        key = self.mesh._controller.process_group(self.mesh._slice, self._reduced, stream.id)
        return (load_group, (key,))

    def __repr__(self) -> str:
        return f"<ProcessGroup over {list(self.dims)} of mesh {self.mesh.name!r}>"


register_special_type(ProcessGroup, ProcessGroup._reduce)


def check_refs(refs: list, mesh: DeviceMesh, stream: Stream) -> None:
    """Refs passed to a command must live on its mesh and stream. A borrow's
    first use is announced before the command that makes it."""
    if recording_trace.anyone is not None and recording_trace.active is not None:
        recording_trace.active.note(refs)
    for r in refs:
        if r.mesh is mesh and r.stream is stream:  # the common case: nothing to check
            if r._borrow is not None:
                r._first_use()
            continue
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
        r._first_use()


class RemoteFunction:
    """A function that runs on the workers: calling it returns a Ref at once."""

    def __init__(self, fn, propagate=None):
        if not callable(fn):
            raise TypeError(f"remote() needs a callable, got {type(fn).__name__}")
        if not (propagate is None or callable(propagate) or propagate in _PROPAGATE):
            raise ValueError(
                f"propagate must be a function (fake inputs -> fake outputs), 'cached' "
                f"or 'inspect', got {propagate!r}"
            )
        self._fn = fn
        self._cached = None
        self._propagate = propagate
        functools.update_wrapper(self, fn, updated=())

    def _function(self) -> m.Function:
        function, self._cached = pickled(self._fn, self._cached)
        return function

    def __call__(
        self, *args, mesh: DeviceMesh | None = None, stream: Stream | None = None, **kwargs
    ) -> Ref:
        if _PENDING_INTERRUPT:  # a Ctrl-C a finalizer dropped: raised in the user's loop
            _raise_pending_interrupt()
        # a propagator needs the engine: load it (it installs itself); else only a loaded one
        engine = TENSOR_ENGINE.get() if self._propagate is not None else TENSOR_ENGINE.value
        if engine is not None and (self._propagate is not None or engine.takes(args, kwargs)):
            return engine.call(self, args, kwargs, mesh, stream)  # it resolves the target
        mesh, stream = resolve_target(mesh, stream)
        return self._send(args, kwargs, mesh, stream)

    def _send(self, args, kwargs, mesh, stream, function: m.Function | None = None) -> Ref:
        """Send the call (``function`` instead of this one's, if given); its Ref."""
        ctrl = mesh._controller
        ctrl.check_usable(mesh.targets)
        if args or kwargs:
            _packing.stream = stream
            try:
                packed, refs = pack_args(args, kwargs)
            finally:
                _packing.stream = None
        else:
            packed, refs = None, ()
        if refs:
            check_refs([r for r in refs if isinstance(r, Ref)], mesh, stream)
        if function is None:
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


_PROPAGATE = ("cached", "inspect")
# the engine installs itself, the package root its loader: this layer never imports it
TENSOR_ENGINE = Hook("tensor_engine", "the tensor engine: .takes(args, kwargs), .call(...)")


def remote(fn=None, *, propagate=None):
    """``remote(torch.ones)`` or ``@remote`` on a def: calls run on the workers.

    Call with ``mesh=`` and ``stream=`` keywords to choose where (default: the
    active mesh and stream); every other argument goes to the function. Refs
    among the arguments (at any depth) become their per-rank values.
    ``propagate`` (a function of fake inputs returning fake outputs, ``"cached"``
    or ``"inspect"``) makes calls return mesh tensors; called with mesh tensors,
    a function without one is ``"cached"``.
    """
    if fn is None:
        if propagate is None:
            return RemoteFunction
        return functools.partial(RemoteFunction, propagate=propagate)
    if isinstance(fn, RemoteFunction) and propagate is None:
        return fn
    if isinstance(fn, RemoteFunction):
        fn = fn._fn
    return RemoteFunction(fn, propagate)
