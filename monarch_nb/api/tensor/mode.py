"""Torch on the active mesh: ``mesh.activate()`` enters a TorchDispatchMode
that sends every aten op (factories included) to that mesh; ``no_mesh()``
lets torch run locally again inside such a block."""

from __future__ import annotations

import contextlib
import os
import sys
import threading

import torch
import torch._guards
from torch._guards import TracingContext
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    _pop_mode,
    _push_mode,
)

from .agreed import agreed_shard
from .dispatch import dispatch, local_only, scalars_only, sent
from .tensor import Tensor

_tls = threading.local()
# ops about the controller itself (torch.autograd.profiler's record_function)
_LOCAL_NAMESPACES = frozenset({"profiler"})
_DEVICE = torch.ops.prim.device.default
_LIFT = torch.ops.aten.lift_fresh.default
_EMPTY = torch.ops.aten.empty.memory_format
_INDEX = torch.ops.aten.index.Tensor
_TO_COPY = torch.ops.aten._to_copy.default
_PAD_PACKED = torch.nn.utils.rnn.pad_packed_sequence.__code__
_LAZY = (
    torch.nn.parameter.UninitializedParameter.__new__.__code__,
    torch.nn.parameter.UninitializedBuffer.__new__.__code__,
)
_guards_tls = getattr(torch._guards, "_TLS", None)
if isinstance(_guards_tls, threading.local):

    def _tracing():
        """``TracingContext.try_get()`` (torch.compile traces: its graphs run on the
        ranks) as one dict lookup: its ``getattr`` with a default costs ~1 us an op."""
        return _guards_tls.__dict__.get("tracing_context")

else:  # another torch: its own call
    _tracing = TracingContext.try_get


class MeshMode(TorchDispatchMode):
    """Within it, aten ops run on ``mesh`` as mesh tensors (see ``dispatch``)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch would wrap __torch_dispatch__ in torch._disable_dynamo (~3 us an op);
        # dynamo does not trace it: traced.py puts monarch_nb in its skip rules
        # (tests/test_tensor_dynamo.py checks no frame of it is compiled)
        return False

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # else torch.compile runs every frame eagerly under the mode (op by op); its
        # graphs are traced with the mode passing ops by (_tracing) and their calls
        # (graphs.py) run with it off
        return True

    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE:  # dynamo's guards read each input's: a wrapper knows its own
            return args[0].device
        if (
            _tls.__dict__.get("local", 0)  # no_mesh(): the thread's own dict, no getattr miss
            or func.namespace in _LOCAL_NAMESPACES
            or _tracing() is not None
        ):
            return func(*args, **(kwargs or {}))
        if func is _EMPTY or func is _INDEX:
            caller = sys._getframe().f_back  # None on a thread of torch's (autograd's)
            code = caller.f_code if caller is not None else None
            if code is _PAD_PACKED:
                # torch's C++ _pad_packed_sequence makes the lengths it returns and writes
                # them through a pointer: a local tensor (the padding runs on the mesh),
                # put in the caller's order by the order every rank agrees on
                if func is _INDEX:
                    args = (args[0], [_agreed(i) for i in args[1]])
                return func(*args, **(kwargs or {}))
            if code in _LAZY:
                raise NotImplementedError(
                    "lazy modules (nn.LazyLinear, nn.LazyConv2d, ...) cannot be built under "
                    "the mesh: their uninitialized parameters are local placeholders that "
                    "torch later fills in place; give the input size (nn.Linear(in, out))"
                )
        if not types and local_only(func, args, kwargs):  # types: mesh tensors' class
            out = func(*args, **(kwargs or {}))
            if type(out) is torch.Tensor and out.dim() and scalars_only(args, kwargs):
                # host scalars made a tensor with dims (generate's eos.unsqueeze(0)): a
                # mesh tensor, as torch.tensor(data) makes, so it may join mesh tensors
                return dispatch(_LIFT, (out,), {}, self.mesh)
            return out
        return dispatch(func, args, kwargs or {}, self.mesh)


@contextlib.contextmanager
def no_mesh():
    """Within this block torch runs locally, even under an active mesh (ops on
    mesh tensors still go to their mesh). The mesh's modes on top of torch's mode
    stack step off it for the block, so local ops do not pass through Python (local
    torch runs at its own speed); one under another mode stays, and lets them by."""
    _tls.local = getattr(_tls, "local", 0) + 1
    off = []
    try:
        while True:
            stack = _get_current_dispatch_mode_stack()
            if not stack or type(stack[-1]) is not MeshMode:
                break
            off.append(_pop_mode())
        yield
    finally:
        for mode in reversed(off):
            _push_mode(mode)
        _tls.local -= 1


def _local_after_fork() -> None:
    """A process forked under an active mesh (a DataLoader's workers, collating
    batches) runs torch locally: it has no controller, only a copy of its modes."""
    _tls.local = getattr(_tls, "local", 0) + 1


os.register_at_fork(after_in_child=_local_after_fork)


def active_mesh():
    """The mesh of the innermost ``mesh.activate()`` block of this thread, or None
    (also inside ``no_mesh()``)."""
    stack = getattr(_tls, "meshes", None)
    if not stack or getattr(_tls, "local", 0):
        return None
    return stack[-1]


@contextlib.contextmanager
def mesh_mode(mesh):
    """The dispatch mode of ``mesh`` for the length of the block (entered by
    ``mesh.activate()``); ``no_mesh`` blocks outside it stay local."""
    saved = getattr(_tls, "local", 0)
    stack = getattr(_tls, "meshes", None)
    if stack is None:
        stack = _tls.meshes = []
    _tls.local = 0
    stack.append(mesh)
    try:
        with MeshMode(mesh):
            yield
    finally:
        stack.pop()
        _tls.local = saved


def _agreed(index):
    return agreed_shard(index, "pad_packed_sequence") if isinstance(index, Tensor) else index


def lifted_parameter(module, name: str, param):
    """A module built under an active mesh gets mesh parameters: a local one registered
    on it there (``nn.Parameter(torch.tensor(1.0))``, whose number stays a local host
    scalar; a parameter of a loaded tensor) becomes one on the mesh holding its value.
    (torch's parameter registration hook; a module's copies and loads register none.)"""
    mesh = active_mesh()
    if mesh is None or isinstance(param, Tensor) or torch.nn.parameter.is_lazy(param):
        return None
    if param.device.type == "meta" or _tracing() is not None:
        return None
    with torch.no_grad():
        value = sent(param.detach(), mesh)
        if mesh.device_type == "cuda" and value.device.type != "cuda":
            value = dispatch(_TO_COPY, (value,), {"device": torch.device("cuda")})
    return torch.nn.Parameter(value, requires_grad=param.requires_grad)


torch.nn.modules.module.register_module_parameter_registration_hook(lifted_parameter)
