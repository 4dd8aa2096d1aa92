"""``loss.backward()`` on a mesh tensor as one command: each rank runs torch's
autograd engine on the graph of its own shards.

Every op that took a tensor requiring grad ran with autograd on the ranks too
(``protocol.autograd``), so each rank holds the graph the controller holds, over
its shards. The controller walks its graph only to find the leaves, sends one
``backward_shards`` command, and names each leaf's new grad with a mesh tensor
of the layout torch gives a leaf's grad. Where the ranks cannot do what torch on
the controller would, the controller's engine runs the backward op by op, as
before: ``create_graph``, ``inputs``, a custom ``autograd.Function`` (its
backward is Python on the controller), TorchScript's graphs, a hook on a tensor
of the graph (``register_hook``, ``retain_grad``, a leaf's post-accumulate hook),
a leaf of another mesh or stream. A second backward through a freed
graph fails on the ranks, with torch's own error.
"""

from __future__ import annotations

import sys

import torch
from torch.autograd.function import BackwardCFunction

from ...protocol.aten import OpSlot
from ...protocol.autograd import backward_shards, data_set, detached
from ...protocol.wire import function_ref
from .aliases import join, leave
from .dispatch import sent, target
from .send import aux_template, define, run
from .tensor import BACKWARD, TORCH_DATA, Tensor

_BACKWARD = function_ref(backward_shards)
_DETACHED = function_ref(detached)
_DATA_SET = function_ref(data_set)
HOOKED = "monarch_nb.hooked"  # a graph node's metadata: a hook the ranks cannot run
_saved_names: dict = {}  # node type -> its _raw_saved_ attributes
_SAVED_TENSOR = torch._C._autograd.SavedTensor
_PYTHON_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.Python) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.PythonTLSSnapshot
)
_FREED = (
    "Trying to backward through the graph a second time (or directly access saved "
    "tensors after they have already been freed): the ranks ran this graph's backward "
    "without retain_graph=True. Specify retain_graph=True if you need to backward "
    "through the graph a second time."
)


def backward(t: Tensor, gradient=None, retain_graph=None, create_graph=False, inputs=None):
    """``t.backward(...)``: on the ranks in one command where they can, else torch's."""
    walked = None
    if (
        not create_graph
        and inputs is None
        and t.grad_fn is not None
        and (gradient is None and t.numel() == 1 or _same_place(gradient, t))
    ):
        walked = _walk(t)
    if walked is None:
        return torch.Tensor.backward(t, gradient, retain_graph, create_graph, inputs)
    leaves, saved = walked
    _send(t, gradient, bool(retain_graph), leaves)
    if not retain_graph:
        _free(saved)
    return None


def mark_hooked(t: Tensor) -> None:
    """A hook on the non-leaf ``t`` (``register_hook``, ``retain_grad``): a backward
    through it runs on the controller, where the hook can run."""
    if t.grad_fn is not None:
        t.grad_fn.metadata[HOOKED] = True


def _same_place(gradient, t: Tensor) -> bool:
    return (
        type(gradient) is Tensor
        and gradient.mesh is t.mesh
        and gradient.stream is t.stream
        and gradient.shape == t.shape
    )


def _walk(t: Tensor) -> tuple | None:
    """``(leaves, saved tensors)`` of ``t``'s graph (each once), or None where the ranks
    cannot run it: a hook, a custom Function, or a tensor saved through saved-tensor
    hooks (``saved_tensors_hooks``, ``checkpoint``, ``save_on_cpu``: the unpacked value
    may differ from the one the ranks saved)."""
    seen = {id(t.grad_fn): t.grad_fn}  # the nodes, kept alive while their ids are keys
    stack = [t.grad_fn]
    leaves: dict = {}
    saved: list = []
    while stack:
        node = stack.pop()
        meta = node.metadata
        if meta and HOOKED in meta:
            return None
        if isinstance(node, BackwardCFunction) or type(node).__name__ == "CppFunction":
            # a custom Function; a C++ node without its own Python type (TorchScript's
            # differentiable graph: the ranks' graph of its ops reads detached inputs)
            return None
        for one in _saved(node):
            if one.unpack_hook is not None:
                return None
            saved.append(one)
        v = getattr(node, "variable", None)
        if v is not None:  # AccumulateGrad
            if not _same_leaf(v, t):
                return None
            leaves[id(v)] = v
        for nxt, _ in node.next_functions:
            if nxt is not None and id(nxt) not in seen:
                seen[id(nxt)] = nxt
                stack.append(nxt)
    return list(leaves.values()), saved


def _free(saved: list) -> None:
    """Drop the controller's ``saved`` tensors of a graph, as torch's engine does once it
    ran them without retain_graph: the mesh tensors only the graph held are freed (on
    the ranks too), and a later use of the graph raises torch's error. torch detaches
    each saved tensor it drops: past the Python key, that detach runs no dispatch of
    ours. One torch refuses to drop (hooked at save) stays until the graph goes."""
    with torch._C._ExcludeDispatchKeyGuard(_PYTHON_KEYS):
        for one in saved:
            try:
                one.register_hooks(_drop, _freed)
            except RuntimeError:  # freed or hooked already
                pass


def _saved(node) -> list:
    """The SavedTensors of ``node`` (its ``_raw_saved_`` attributes)."""
    names = _saved_names.get(type(node))
    if names is None:
        names = _saved_names[type(node)] = tuple(
            a for a in dir(type(node)) if a.startswith("_raw_saved_")
        )
    found = []
    for name in names:
        saved = getattr(node, name)
        for one in saved if type(saved) in (list, tuple) else (saved,):
            # (a list of an optional tensor holds None; an input autograd had no need to
            # save is an undefined SavedTensor, whose register_hooks would raise)
            if type(one) is _SAVED_TENSOR and one.data is not None:
                found.append(one)
    return found


def _drop(_t) -> None:
    return None


def _freed(_packed):
    raise RuntimeError(_FREED)


def _same_leaf(v, t: Tensor) -> bool:
    return (
        type(v) is Tensor
        and v.mesh is t.mesh
        and v.stream is t.stream
        and not v._deleted
        and not v._backward_hooks
        and not getattr(v, "_post_accumulate_grad_hooks", None)
    )


# torch 2.13 named it ..._or_false (a symbolic size answers False)
_dense = getattr(torch._prims_common, "is_non_overlapping_and_dense_or_false", None) or getattr(
    torch._prims_common, "is_non_overlapping_and_dense", lambda t: False
)


def _grad_layout(leaf: Tensor) -> tuple:
    """``(size, stride)`` torch gives a leaf's grad: the leaf's strides where it is
    dense and non-overlapping, else contiguous."""
    size = tuple(leaf.shape)
    if leaf.is_contiguous() or _dense(leaf):
        return size, tuple(leaf.stride())
    stride, acc = [], 1
    for n in reversed(size):
        stride.append(acc)
        acc *= max(n, 1)
    return size, tuple(reversed(stride))


def _send(t: Tensor, gradient, retain: bool, leaves: list) -> None:
    grads = [lf.grad for lf in leaves]
    layouts = [_grad_layout(lf) for lf in leaves]
    spec = (
        gradient is not None,
        retain,
        tuple((g is not None, size, stride) for g, (size, stride) in zip(grads, layouts)),
    )
    refs = [t, *([gradient] if gradient is not None else []), *leaves]
    refs += [g for g in grads if g is not None]
    # it reads them; the grads it makes are new tensors: it writes none
    mesh, stream, ctrl = target(refs, t.mesh, "backward()", ())
    skeleton = (spec, *[OpSlot(i) for i in range(len(refs))])
    op = define(ctrl, aux_template(("backward", spec), skeleton, _BACKWARD, "backward"))
    ident, ids = ctrl.next_ident(), tuple([ctrl.next_id() for _ in leaves])
    wire = tuple([r._wire_id() for r in refs])
    ctrl.send_op((ident, ids, op, wire, stream.id, ()), mesh.targets, "backward")
    with torch.no_grad():
        for leaf, rid, (size, stride) in zip(leaves, ids, layouts):
            layout = (size, stride, 0, leaf.dtype, leaf.device)
            leaf.grad = Tensor(layout, rid, mesh, stream, ident)


def detach_(t: Tensor) -> Tensor:
    """``t.detach_()``: torch ends ``t``'s graph here without a dispatch (autograd's
    own kernel), so each rank's shard is replaced by its detached alias too; else a
    rank's graph would go on through it, and a later backward would fill other
    tensors' grads there than here."""
    torch.Tensor.detach_(t)
    if t._layout is not None:  # not a torch.compile trace
        mesh, stream, ctrl = target([t], t.mesh, "detach_", ())
        template = aux_template(("detached",), (OpSlot(0),), _DETACHED, "detach_")
        t._rebind(*run(ctrl, template, (t,), {}, (t,), mesh, stream, "detach_"))
    return t


def set_data(t: Tensor, new) -> None:
    """``t.data = new``: torch swaps ``t``'s storage and layout for ``new``'s without a
    dispatch (keeping ``t``'s identity, grad and graph), so each rank's shard does the
    same; a local ``new`` goes to ``t``'s ranks first. ``t`` then shares ``new``'s
    storage (and leaves its old views), as in torch."""
    if not isinstance(new, torch.Tensor):
        raise TypeError(f"t.data = x: x must be a tensor, not {type(new).__name__}")
    if t._layout is None:  # a torch.compile trace's wrapper: torch's own
        TORCH_DATA.__set__(t, new)
        return
    if not isinstance(new, Tensor):
        new = sent(new, t.mesh)
    mesh, stream, ctrl = target([t, new], t.mesh, "t.data = x", (0,))
    template = aux_template(("data_set",), (OpSlot(0), OpSlot(1)), _DATA_SET, "t.data = x")
    rid, ident = run(ctrl, template, (t, new), {}, (t, new), mesh, stream, "t.data = x")
    TORCH_DATA.__set__(t, new)
    t._layout = new._layout
    t._rebind(rid, ident)
    leave(t)
    join(t, new)


BACKWARD.install(sys.modules[__name__])  # mesh tensors' backward() comes here
