"""Mesh tensors under ``torch.compile``: a traceable wrapper of one shard.

To dynamo and AOTAutograd a mesh tensor is a wrapper subclass with one inner
tensor, its *shard*: a FakeTensor of its layout (``shard_of``), so the graphs
they trace over the inner tensors are each rank's own program, which the mesh
backend (``graphs``) sends to the ranks once and runs there as one command a
call. While they trace, a mesh tensor is ``traced`` (its ``_layout`` None): its
shard is the tracer's (fake, functional or proxied), its ops run on that shard
and make nothing on the mesh. At run time the graph's outputs come back as shards
naming values on the ranks (``owned``), and ``unflatten`` makes them mesh
tensors again.
"""

from __future__ import annotations

import functools
import sys
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _disable_current_modes, return_and_correct_aliasing
from torch.utils._pytree import tree_map

from ...protocol.wire import RefUseError
from ..context import RecordingError
from .propagate import _fake, op_name
from .tensor import TRACING, Tensor

__all__ = [
    "Place",
    "dispatch",
    "hand_over",
    "owned",
    "shard_of",
    "traced",
    "unflatten",
    "value_of",
]

_META = torch.device("meta")
_OUTER = "_mnb_outer"  # a run-time shard's attribute: its mesh tensor (a weakref or _Strong)
# the storage of each run-time shard -> [the shard's layout, its mesh tensor as _OUTER
# holds it, a weakref to the storage]. torch hands a graph's shards on as new tensors of
# the same storage (the copies autograd saves, views), so a shard is known by its
# storage, and a graph output's value lives as long as that storage does: the weakref's
# callback (on the storage's Python object, which torch keeps while the storage lives)
# forgets it. (A plain weakref, kept by the entry: ~1 us to make and fire against
# weakref.finalize's 2-4, and a step of the dynamo LM makes 31.)
_LIVE: dict = {}


class Place:
    """Where a mesh tensor lives (its mesh and stream): what torch.compile keeps of it
    beside its shard, and guards on (the same mesh object, the same stream)."""

    __slots__ = ("mesh", "stream")

    def __init__(self, mesh, stream):
        self.mesh, self.stream = mesh, stream

    def __eq__(self, other) -> bool:
        return type(other) is Place and (other.mesh, other.stream.id) == (self.mesh, self.stream.id)

    def __hash__(self) -> int:
        return hash((id(self.mesh), self.stream.id))

    def __deepcopy__(self, memo):  # dynamo's guard keeps a copy: the same place
        return self

    def __repr__(self) -> str:
        return f"Place({self.mesh.name!r}, {self.stream.name!r})"


class _Strong:
    """A strong reference called like a weakref: a graph output's mesh tensor."""

    __slots__ = ("t",)

    def __init__(self, t):
        self.t = t

    def __call__(self):
        return self.t


def _remember(shard: torch.Tensor, holder) -> None:
    setattr(shard, _OUTER, holder)
    storage = shard.untyped_storage()
    cdata = storage._cdata
    _LIVE[cdata] = [_layout(shard), holder, weakref.ref(storage, _forgetter(cdata))]


def _forgetter(cdata: int):
    def forget(ref) -> None:
        """A shard's storage died: its value is freed (unless its mesh tensor lives on).
        Only its own entry: a storage made later at the same address has another."""
        entry = _LIVE.get(cdata)
        if entry is not None and entry[2] is ref:
            del _LIVE[cdata]

    return forget


def shard_of(t: Tensor) -> torch.Tensor:
    """The shard a mesh tensor shows torch.compile: a FakeTensor of its layout that
    leads back to it (made again when its layout changed)."""
    if t._layout is None:
        return t._traced_shard
    convert = sys.modules.get("torch._dynamo.symbolic_convert")  # loaded once dynamo runs
    tx = getattr(getattr(convert, "tls", None), "current_tx", None)
    if tx is not None:  # dynamo traces a frame: with which backend?
        _check_backend(tx)
    cached = t.__dict__.get("_shard_cache")
    if cached is not None and cached[0] == t._layout:
        return cached[1]
    with _disable_current_modes(), _shard_mode():
        shard = _fake(t._layout)
    _remember(shard, weakref.ref(t))
    t._shard_cache = (t._layout, shard)
    return shard


ON_THE_MESH = "_mnb_on_the_mesh"  # a torch.compile backend whose graphs run on the ranks


_TORCH_DIR = torch.__file__.rpartition("/")[0]
_OUR_DIR = __file__.rpartition("/api/")[0] + "/"
# the frames torch compiles to run a higher-order op eagerly: (what it is, what to do)
_HIGHER_ORDER = {
    "_cond_op_wrapper": ("torch.cond", "choose the branch with pred.item() or torch.where"),
    "_while_loop_op_wrapper": ("torch while_loop", "loop in Python, reading the condition"),
    "_flex_attention_hop_wrapper": ("flex_attention", "use F.scaled_dot_product_attention "
                                    "with attn_mask (the score_mod as a bias or mask)"),
}


def _check_backend(tx) -> None:
    """Dynamo meets a mesh tensor: refused for a backend that would run its graphs
    here, on the shards, which hold no data (inductor's kernels read them: the process
    crashed). ``mnb.mesh_backend`` and dynamo's ``eager`` (torch's own ops) run on the
    mesh."""
    from torch._dynamo.eval_frame import innermost_backend
    from torch._dynamo.exc import SkipFrame

    if tx.output.root_tx.f_code.co_filename.startswith(_OUR_DIR):
        # our dispatch's frame, met before any mesh tensor (nn.Module.compile runs torch's
        # frames eagerly): run as it is; _shard_mode skips this package from now on
        _shard_mode()
        raise SkipFrame("monarch_nb's dispatch of mesh tensors runs as it is")
    hop = _HIGHER_ORDER.get(tx.f_code.co_name)
    if hop is not None and tx.f_code.co_filename.startswith(_TORCH_DIR):
        raise NotImplementedError(
            f"{hop[0]} on mesh tensors: torch runs it by tracing it with torch.compile, whose "
            f"tracer cannot run a higher-order op on mesh tensors (inside a compiled function "
            f"either); {hop[1]}, or call it on the shards inside mnb.remote(fn, propagate=...)"
        )
    fn = innermost_backend(tx.output.compiler_fn)
    fn = getattr(fn, "compiler_fn", fn)  # torch.compile's wrapper of a backend
    if getattr(fn, ON_THE_MESH, False) or getattr(fn, "__name__", "") == "eager":
        return
    name = getattr(fn, "compiler_name", None) or getattr(fn, "__name__", type(fn).__name__)
    raise RefUseError(
        f"torch.compile's backend {name!r} would run the graph of mesh tensors here, "
        f"where their values are not: compile functions of mesh tensors with "
        f"torch.compile(fn, backend=mnb.mesh_backend)"
    )


@functools.cache
def _shard_mode() -> FakeTensorMode:
    """The mode of the shards mesh tensors show torch.compile (one for every thread:
    dynamo makes fakes of its own), made when torch.compile meets its first mesh
    tensor; dynamo then skips this package (our dispatch, not the user's code)."""
    from torch._dynamo import trace_rules

    trace_rules.add("monarch_nb")
    return FakeTensorMode(allow_non_fake_inputs=True)


def hand_over(t: Tensor) -> bool:
    """``t``, once shown to torch.compile, is being deleted: its value lives on
    while a shard's storage does (a copy autograd saved for a compiled backward
    may read it), held by a new mesh tensor (True: do not free it now). A graph's
    output that a later graph took as an input has two shards: both are."""
    if t.generation != t.mesh._controller.generation:
        return False  # the mesh restarted: the value is gone
    held = _hand_over_shown(t)
    shard = t.__dict__.get("_shard_kept")  # a graph's output (``owned``)
    if shard is None:
        return held is not None
    storage = shard.untyped_storage()
    entry = _LIVE.get(storage._cdata)
    if entry is None or _alone(shard, storage):
        return held is not None
    if held is None:
        held = _holder(t)
    entry[1] = held
    setattr(shard, _OUTER, held)
    return True


def _hand_over_shown(t: Tensor):
    """The new holder of ``t``'s value for the shard ``shard_of`` showed torch.compile
    (a graph's input), while that shard's storage lives; else None."""
    cached = t.__dict__.get("_shard_cache")
    if cached is None:
        return None
    entry = _LIVE.get(cached[1].untyped_storage()._cdata)
    if entry is None:
        return None
    held = entry[1] = _holder(t)
    setattr(cached[1], _OUTER, held)
    return held


def _holder(t: Tensor) -> _Strong:
    """A new mesh tensor naming ``t``'s value, held by a shard's entry."""
    return _Strong(Tensor(t._layout, t.id, t.mesh, t.stream, t.ident))


def _alone(shard: torch.Tensor, storage) -> bool:
    """Whether nothing but the dying mesh tensor holds ``shard`` (a graph output's) or
    its storage, as for a gradient dropped by ``zero_grad``: its value may go now."""
    if _ALONE is None:
        return False
    refs, uses, storage_uses = _counts(shard, storage)
    return refs <= _ALONE[0] and uses <= _ALONE[1] and storage_uses <= _ALONE[2]


def _counts(shard: torch.Tensor, storage) -> tuple:
    return sys.getrefcount(shard), shard._use_count(), torch._C._storage_Use_Count(storage._cdata)


def _baseline() -> tuple:
    """``_counts`` of an ``owned`` shard held by its mesh tensor alone, as ``hand_over``
    sees it (they differ between versions of torch)."""
    shard = _fake(((1,), (1,), 0, torch.float32, _META))
    held = {"_shard_kept": shard}  # noqa: F841 - the mesh tensor's reference
    storage = shard.untyped_storage()
    return _as_hand_over(shard, storage)


def _as_hand_over(shard, storage) -> tuple:  # one frame, as _alone's between
    return _counts(shard, storage)


try:
    _ALONE = _baseline()
except AttributeError:  # a torch without these counts: every such value is handed over
    _ALONE = None


class _Made:
    """A graph output's value on the ranks, freed when this goes unless its mesh
    tensor took it over: made on first call, held weakly (autograd steals a grad
    only from a tensor nothing else holds), it frees the value from then on, or
    hands it over (``hand_over``) while torch still holds a copy of its shard."""

    __slots__ = ("fields", "t")

    def __init__(self, value: int, ident: int, mesh, stream, layout: tuple):
        self.fields, self.t = (value, ident, mesh, stream, layout), None

    def __call__(self) -> Tensor | None:
        return None if self.t is None else self.t()

    def named(self) -> tuple | None:
        """``(value id, ident, mesh, stream)`` while this holds the value itself."""
        return self.fields[:4] if self.t is None else None

    def tensor(self, shard: torch.Tensor) -> Tensor:
        """Its mesh tensor, made on first call; it frees the value from then on (or
        hands it over while torch holds a tensor of ``shard``'s storage)."""
        t = self()
        if t is None:
            value, ident, mesh, stream, layout = self.fields
            t = Tensor(layout, value, mesh, stream, ident)
            t._shard_kept = shard
            self.t = weakref.ref(t)
        return t

    def __del__(self):
        if self.t is None:
            mesh = self.fields[2]
            mesh._controller.delete_ref(self.fields[0])


def owned(layout: tuple, value: int, ident: int, mesh, stream) -> torch.Tensor:
    """The shard of a graph's output, the value ``value`` on the ranks of ``mesh``
    (made on ``stream``): a meta tensor of ``layout`` (torch only passes it on);
    the value lives while its storage does (``_forgetter``), or longer if the user holds
    its mesh tensor."""
    shard = _fake((*layout[:4], _META))
    _remember(shard, _Made(value, ident, mesh, stream, layout))
    return shard


def value_of(shard, keep: list) -> tuple | None:
    """``(value id, ident, mesh, stream)`` a run-time shard names, or None for a
    tensor that is no mesh tensor's shard. A view (or copy) torch made of a shard
    names that view of its mesh tensor on the ranks (kept alive in ``keep``)."""
    outer = getattr(shard, _OUTER, None)
    if outer is None:
        if not isinstance(shard, torch.Tensor):
            return None
        entry = _LIVE.get(shard.untyped_storage()._cdata)
        if entry is None:
            return None
        outer = entry[1]
        if _layout(shard) != entry[0]:
            t = outer.tensor(shard) if type(outer) is _Made else outer()
            if t is not None:
                keep.append(t)
                t = torch.ops.aten.as_strided.default(
                    t, tuple(shard.shape), tuple(shard.stride()), shard.storage_offset()
                )
                keep.append(t)
                return t._wire_id(), t.ident, t.mesh, t.stream
    if type(outer) is _Made:
        named = outer.named()
        if named is not None:
            return named
    t = outer()
    if t is None:  # torch.compile held only the shard: its tensor is gone
        raise RecordingError("a compiled graph's input was freed before the graph ran")
    return t._wire_id(), t.ident, t.mesh, t.stream


def unflatten(shard, place: Place, outer_size, outer_stride) -> Tensor:
    """The mesh tensor of ``shard``: a graph output's or the tensor a run-time shard
    leads back to, or one a tracer made (``traced``)."""
    outer = getattr(shard, _OUTER, None)
    if type(outer) is _Made:
        return outer.tensor(shard)
    t = outer() if outer is not None else None
    return traced(shard, place.mesh, place.stream) if t is None else t


def _layout(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, t.device)


_NOT_OURS = (
    "a mesh tensor torch.compile made while it traced reached the mesh: compile "
    "functions of mesh tensors with torch.compile(fn, backend=mnb.mesh_backend)"
)


def traced(shard: torch.Tensor, mesh, stream) -> Tensor:
    """A mesh tensor while torch.compile traces (``_layout`` None): ops on it run on
    its shard (the tracer's) and send nothing; it names no value on the ranks. It is
    of mesh tensors' own class, as AOTAutograd checks the class of what it rebuilds."""
    t = torch.Tensor._make_wrapper_subclass(
        Tensor,
        shard.size(),
        strides=shard.stride(),
        storage_offset=shard.storage_offset(),
        dtype=shard.dtype,
        device=shard.device,
        requires_grad=shard.requires_grad,
    )
    t._traced_shard = shard
    # a Ref's fields, naming nothing: delete() and __del__ do nothing
    t.id, t.ident, t.mesh, t.stream = 0, 0, mesh, stream
    t.generation, t._deleted = -1, True
    t._borrow = t._aliases = None
    t._gone = _NOT_OURS
    t._layout = None
    return t


def dispatch(func, args, kwargs):
    """An op while torch.compile traces (``dispatch.dispatch`` sends one here when a
    mesh tensor among its arguments is traced): run on the shards."""
    where: list = []

    def inner(x):
        if type(x) is Tensor or isinstance(x, Tensor):
            if x._layout is not None:
                raise RecordingError(
                    f"{op_name(func)}: a mesh tensor torch.compile did not take as an "
                    f"input of its graph (made inside the compiled function under "
                    f"mesh.activate()?); make it outside and pass it in"
                )
            if not where:
                where.append((x.mesh, x.stream))
            return x._traced_shard
        return x

    out = func(*tree_map(inner, args), **tree_map(inner, kwargs))
    mesh, stream = where[0]

    def outer(o):
        return traced(o, mesh, stream) if isinstance(o, torch.Tensor) else o

    return return_and_correct_aliasing(func, args, kwargs, tree_map(outer, out))


TRACING.install(sys.modules[__name__])  # mesh tensors' __tensor_flatten__ comes here
