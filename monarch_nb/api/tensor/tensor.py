"""``mnb.Tensor``: a torch tensor whose shards live on the ranks of a mesh.

It is a wrapper subclass: the controller knows its layout (size, stride,
dtype, device; from FakeTensor propagation) but holds no data, and each rank
holds one shard of that layout. It is also a ``Ref`` to those shards, so it
goes wherever a Ref goes (remote-function arguments, ``fetch``, ``reduce``,
``%%monarch --push``).
"""

from __future__ import annotations

import weakref

import torch

from ...hooks import Hook
from ...protocol.autograd import shard_value
from ...protocol.wire import function_ref, register_ref_type
from ..context import recording_trace
from ..remote import Ref
from . import borrows
from .agreed import agreed_shard

_make_wrapper = torch.Tensor._make_wrapper_subclass
_NOT_SAVED = (
    "a mesh tensor holds no values here (its shards live on the ranks), so torch.save and "
    "pickle cannot save it: bring the values here first (mnb.inspect(t); a state dict: "
    "{k: mnb.inspect(v) for k, v in model.state_dict().items()}), or save them where they "
    "are with mesh.save(path, model=model) (torch.distributed.checkpoint)"
)
_REFUSALS = (
    _NOT_SAVED,
    "a function sent to the workers by value refers to a mesh tensor (in its closure or "
    "globals): pass the tensor as an argument instead (mnb.remote(fn)(t) gives fn each "
    "rank's shard of t)",
)


class Tensor(torch.Tensor, Ref):
    """A tensor on a mesh: torch ops on it run on every rank (one remote call
    each); its values come back with ``mnb.inspect(t)`` or ``t.fetch()``."""

    _fetched = function_ref(shard_value)  # a shard comes back without its rank's graph
    # torch functions and attributes (.grad, .data) go straight to __torch_dispatch__:
    # Tensor's own __torch_function__ is Python run on every call (~2-3 us, more for a list)
    __torch_function__ = torch._C._disabled_torch_function_impl
    # Ref's, not torch.Tensor's (first in the MRO), with a mesh tensor's words
    __reduce_ex__ = Ref.__reduce_ex__
    _refusals = _REFUSALS
    # a Ref's fields and its own in slots: read ~10 times a tensor an op, a slot costs a
    # quarter of a tensor's __dict__ (torch keeps that at a negative offset, which
    # Python's fast attribute paths skip). Every one is set where a Tensor is made.
    # _aliases: weakrefs to the tensors sharing its storage (aliases.join)
    __slots__ = (
        "id", "ident", "mesh", "stream", "generation", "_layout", "_deleted", "_borrow", "_aliases"
    )

    @staticmethod
    def __new__(cls, layout: tuple, ref_id: int, mesh, stream, ident: int):
        size, stride, offset, dtype, device = layout
        # requires_grad defaults to False, storage_offset to 0: each keyword parsed costs,
        # and the dispatcher makes ~1.6 tensors an op
        if offset:
            t = _make_wrapper(
                cls, size, strides=stride, storage_offset=offset, dtype=dtype, device=device
            )
        else:
            t = _make_wrapper(cls, size, strides=stride, dtype=dtype, device=device)
        t._deleted = False
        t._borrow = t._aliases = None
        Ref.__init__(t, ref_id, mesh, stream, ident)
        t._layout = layout
        trace = recording_trace.anyone and recording_trace.active
        if trace is not None:  # mnb.compile: a tensor made while recording may be state
            trace.made.append(weakref.ref(t))
        return t

    def __init__(self, *args, **kwargs):  # everything happened in __new__
        pass

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return DISPATCH.value.dispatch(func, args, kwargs or {})

    # ------------------------------------------------- torch.compile (traced.py)

    def __tensor_flatten__(self):
        """To torch.compile a wrapper of one shard (a FakeTensor of its layout): the
        graphs it traces are each rank's program (``graphs.py`` runs them there)."""
        return ["_shard"], TRACING.value.Place(self.mesh, self.stream)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return TRACING.value.unflatten(inner["_shard"], ctx, outer_size, outer_stride)

    @property
    def _shard(self):
        return TRACING.value.shard_of(self)

    def __deepcopy__(self, memo):
        """A copy on the same mesh and stream (one clone per rank); a parameter's copy
        is a parameter (``copy.deepcopy(model)`` under a mesh)."""
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            copy = torch.ops.aten.clone.default(self)
        if self.requires_grad:
            copy.requires_grad_(True)
        if getattr(self, "_is_param", False):
            copy._is_param = True
        memo[id(self)] = copy
        return copy

    def backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
        """``torch.Tensor.backward``, run by each rank's autograd engine on its shards
        in one command where it can (see ``backward.py``)."""
        return BACKWARD.value.backward(self, gradient, retain_graph, create_graph, inputs)

    @property
    def data(self):
        return TORCH_DATA.__get__(self)

    @data.setter
    def data(self, new):
        BACKWARD.value.set_data(self, new)

    def detach_(self):
        return BACKWARD.value.detach_(self)

    def register_hook(self, hook):
        BACKWARD.value.mark_hooked(self)
        return super().register_hook(hook)

    def retain_grad(self):
        BACKWARD.value.mark_hooked(self)
        return super().retain_grad()

    def _rebind(self, ref_id: int, ident: int) -> None:
        """An in-place op made the value ``ref_id`` (the same storage on each rank):
        from now on this tensor names it, so a failure of that op reaches its users."""
        old = self.id
        self.id, self.ident = ref_id, ident
        self.mesh._controller.delete_ref(old)

    # ---------------------------------------------------------------- display

    def __repr__(self, *, tensor_contents=None) -> str:
        dims = ", ".join(f"{k}={v}" for k, v in self.mesh.dims.items())
        grad = ", requires_grad=True" if self.requires_grad else ""
        state = ", deleted" if self._deleted else ""
        return (
            f"mnb.Tensor(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"mesh={self.mesh.name!r} ({dims}), stream={self.stream.name!r}{grad}{state})"
        )

    def __str__(self) -> str:
        return f"{self.__repr__()}  [values: mnb.inspect(t)]"

    def __format__(self, spec: str) -> str:
        if spec and self.dim() == 0:  # f"{loss:.4f}": the number, as torch formats it
            return format(self.item(), spec)
        return self.__str__() if not spec else format(self.__str__(), spec)

    # ------------------------------------------- values: the one every rank holds

    def item(self):
        """The number every rank holds (asked of each); ranks that differ: an error."""
        return agreed_shard(self, "t.item()").item()

    def tolist(self):
        return agreed_shard(self, "t.tolist()").tolist()

    def numpy(self, *args, **kwargs):
        return agreed_shard(self, "t.numpy()").numpy(*args, **kwargs)

    def __bool__(self):
        return bool(agreed_shard(self, "bool(t)"))

    def __float__(self):
        return float(agreed_shard(self, "float(t)"))

    def __int__(self):
        return int(agreed_shard(self, "int(t)"))

    def __index__(self):
        return agreed_shard(self, "using a mesh tensor as an index").__index__()

    def __array__(self, *args, **kwargs):
        return agreed_shard(self, "numpy.asarray(t)").__array__(*args, **kwargs)

    # ---------------------------------------------------------------- collectives

    def reduce(
        self,
        dims,
        reduction: str = "sum",
        scatter: bool = False,
        inplace=False,
        out=None,
        mesh=None,
    ):
        """``Ref.reduce`` (see there) returning a mesh tensor with the result's layout;
        ``mesh``: where the result lives (a slice of this tensor's mesh, whose ranks
        hold it already, e.g. ``mesh.slice(gpu=0)`` for a reduce to one rank per host;
        another mesh gets a copy)."""
        if mesh is not None and mesh is not self.mesh:
            if inplace or out is not None:
                raise ValueError("reduce(mesh=...) makes a new tensor: no inplace=True or out=")
            whole = self.reduce(dims, reduction, scatter)
            inside = mesh._controller is self.mesh._controller and set(mesh.targets) <= set(
                self.mesh.targets
            )
            if not inside:
                return whole.to_mesh(mesh)
            return DISPATCH.value.dispatch(torch.ops.aten.alias.default, (whole,), {}, mesh)
        ref = Ref.reduce(self, dims, reduction, scatter, inplace, out)
        dims = (dims,) if isinstance(dims, str) else tuple(dims)
        sizes = [self.mesh.dims[d] for d in dict.fromkeys(dims)]
        n = 1
        for s in sizes:
            n *= s
        shape = tuple(self.shape)
        if reduction == "stack":
            shape = shape if scatter else (*sizes, *shape)
        elif scatter:
            shape = shape[1:]
        if inplace or out is not None:
            target = self if inplace else out
            if isinstance(target, Tensor):
                target._rebind(ref.id, ref.ident)
                ref._deleted = True  # the target names it now
                if target._aliases is not None:  # its views and base: after the reduce
                    DISPATCH.value.rename_aliases(target, target.mesh, target.stream)
                return target
            return ref
        return _from_ref(ref, shape, self.dtype, self.device)

    def reduce_(self, dims, reduction: str = "sum", scatter: bool = False):
        """``reduce(..., inplace=True)``: this tensor holds the result; returns it."""
        return self.reduce(dims, reduction, scatter, inplace=True)

    def to_mesh(self, other):
        """``Ref.to_mesh``: a mesh tensor of the same layout on ``other``."""
        ref = Ref.to_mesh(self, other)
        return _from_ref(ref, tuple(self.shape), self.dtype, self.device)

    def borrow(self, stream, mutable: bool = False):
        """``Ref.borrow``: this tensor (same layout) for use on ``stream``; ``del``
        (or ``delete()``) drops the borrow. See ``stream.borrow`` for ``mutable``."""
        ref = Ref.borrow(self, stream)
        t = Tensor(self._layout, ref.id, ref.mesh, ref.stream, ref.ident)
        t._borrow, ref._borrow = ref._borrow, None
        ref._deleted = True
        borrows.lend(self, t, mutable)
        return t

    def delete(self) -> None:
        if not self._deleted:
            borrows.returned(self)
            # getattr, not self.__dict__ (that would make the dict most tensors never
            # have), and into no local: hand_over counts who else holds the shard
            compiled = (
                getattr(self, "_shard_cache", None) is not None
                or getattr(self, "_shard_kept", None) is not None
            )
            if compiled and self._borrow is None and TRACING.value.hand_over(self):
                self._deleted = True  # a compiled backward still reads its value
                return
        Ref.delete(self)


def _from_ref(ref: Ref, shape: tuple, dtype, device) -> Tensor:
    """A contiguous mesh tensor naming ``ref``'s value (which ``ref`` gives up)."""
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    layout = (shape, tuple(reversed(stride)), 0, dtype, device)
    t = Tensor(layout, ref.id, ref.mesh, ref.stream, ref.ident)
    ref._deleted = True
    return t


register_ref_type(Tensor, Ref._wire_id)

# torch's .data: mesh tensors keep its getter; its setter swaps the metadata here only
# (backward.set_data runs it once each rank's shard did the same)
TORCH_DATA = torch._C.TensorBase.data

# dispatch.py builds Tensors; it installs itself here when it loads (tensor/__init__)
DISPATCH = Hook("tensor_dispatch", "the mesh tensor's op dispatch: .dispatch, .rename_aliases")
# backward.py: a mesh tensor's backward() (.mark_hooked: a hook the ranks cannot run)
BACKWARD = Hook(
    "tensor_backward", "a mesh tensor's backward(), detach_() and .data = x, run on its ranks"
)
# traced.py: a mesh tensor's shard as torch.compile sees it (.shard_of, .unflatten)
TRACING = Hook("tensor_tracing", "mesh tensors under torch.compile: their shards")
