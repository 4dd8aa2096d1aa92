"""Output layouts of an aten op, from FakeTensor propagation on the controller.

``propagate`` runs the op on fake tensors with the inputs' layouts and
describes its outputs; the dispatcher caches the description by (op, input
layouts, arguments), so a repeated op never reaches FakeTensorMode again.

A description is ``("one", spec, base)``, ``("many", container type, [spec,
...], [base, ...])``, ``("value", v)`` (an op whose result is no tensor) or
``("relayout", i, layout)`` (an in-place view op: input ``i`` takes ``layout``). A
spec is a layout ``(size, stride, storage_offset, dtype, device)``, an int
``i`` (the output is input tensor ``i`` itself: an in-place or ``out=`` op),
or None; a base is the index of the input a new output is a view of, or None.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map

from .cpu_layouts import run_fake

_tls = threading.local()
_DETACH = torch.ops.aten.detach.default
# ops whose argument at this place asks for a sparse gradient of the weight
_SPARSE_GRAD = {torch.ops.aten.embedding.default: 4, torch.ops.aten._embedding_bag.default: 5}
_grad_on = torch.is_grad_enabled


def _fake_mode() -> FakeTensorMode:
    mode = getattr(_tls, "mode", None)
    if mode is None:
        mode = _tls.mode = FakeTensorMode()
    return mode


def layout_of(t: torch.Tensor) -> tuple:
    """The layout tuple of a (real, fake or mesh) tensor."""
    return (tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, t.device)


def _fake(layout: tuple) -> torch.Tensor:
    """An empty tensor of ``layout`` (under a FakeTensorMode, a fake one): one call
    where it starts its storage, else a view of a storage that ends where it does."""
    size, stride, offset, dtype, device = layout
    if not offset:
        return torch.empty_strided(size, stride, dtype=dtype, device=device)
    extent = sum((n - 1) * s for n, s in zip(size, stride)) + 1 if all(size) else 0
    base = torch.empty((offset + extent,), dtype=dtype, device=device)
    return base.as_strided(size, stride, offset)


@contextlib.contextmanager
def fake_inputs(args, kwargs, tensors: list, is_mesh):
    """``(fake args, fake kwargs, fakes)``: the mesh tensors ``tensors`` among ``args``
    and ``kwargs`` swapped for FakeTensors of their layouts (a local tensor for its
    fake), for the length of the block, in which FakeTensorMode is the only mode: the
    mesh's mode (an active ``mesh.activate()``) and any other are off, so nothing
    made here can become a mesh tensor (or a fake be cached as one)."""
    with _disable_current_modes():
        mode = _fake_mode()
        fakes = _fakes_for([t._layout for t in tensors], mode)
        index = {id(t): i for i, t in enumerate(tensors)}

        def swap(x):
            if is_mesh(x):
                return fakes[index[id(x)]]
            if isinstance(x, torch.Tensor):  # a local tensor (0-dim, sent by value)
                return mode.from_tensor(x)
            return x

        fargs, fkwargs = tree_map(swap, (tuple(args), dict(kwargs)))
        with mode:
            yield fargs, fkwargs, fakes


def _fakes_for(layouts: list, mode: FakeTensorMode) -> list:
    """Fake inputs of these layouts, made once each (making one costs more than most
    ops): the k-th input of a layout in a call reuses the k-th fake of that layout,
    so distinct inputs stay distinct tensors (an ``out=`` must be told apart)."""
    cache = getattr(_tls, "fakes", None)
    if cache is None:
        cache = _tls.fakes = {}
    seen: dict = {}
    out = []
    for layout in layouts:
        k = seen[layout] = seen.get(layout, -1) + 1
        f = cache.get((layout, k))
        if f is None:
            with mode:
                f = cache[(layout, k)] = _fake(layout)
            if len(cache) > 4096:
                cache.clear()
        out.append(f)
    return out


def op_name(func) -> str:
    """``aten.add.Tensor``, ``aten.mm`` (a default overload unnamed): how errors and
    the dashboard name an op."""
    return str(func).removesuffix(".default")


class DataDependentError(RuntimeError):
    """An op whose result's layout (or value) FakeTensor cannot know: it depends on
    the values (``nonzero``, ``masked_select``, ``unique``, ``item()``)."""


def needs_values_error(what: str, cls=RuntimeError) -> RuntimeError:
    return cls(
        f"{what} needs the values of a mesh tensor, which live on the workers: "
        f"bring one shard back with mnb.inspect(t) (or every shard with t.fetch())"
    )


def propagate(func, args, kwargs, tensors: list, is_mesh) -> tuple:
    """The description of ``func``'s outputs for mesh tensors ``tensors`` (in the
    order the dispatcher numbered them) among ``args`` / ``kwargs``."""
    name = op_name(func)
    if "nested" in func.name():
        raise NotImplementedError(
            f"{name}: mesh tensors cannot be nested tensors, which nn.TransformerEncoder's "
            f"fast path makes of a padding mask under no_grad or inference_mode: build it "
            f"with enable_nested_tensor=False (locally too, to compare: the nested path "
            f"gives other numbers)"
        )
    at = _SPARSE_GRAD.get(func)
    if at is not None and len(args) > at and args[at] and args[0].requires_grad and _grad_on():
        raise NotImplementedError(
            f"{name} with sparse=True makes a sparse gradient, which a mesh tensor cannot "
            f"be (mesh tensors are dense): build the embedding with sparse=False (the "
            f"optimizer then steps it as any parameter)"
        )
    try:
        with fake_inputs(args, kwargs, tensors, is_mesh) as (fargs, fkwargs, fakes):
            out = run_fake(func, fargs, fkwargs)
    except (DataDependentOutputException, DynamicOutputShapeException):
        raise needs_values_error(f"{name} (its result depends on the data)", DataDependentError) from None
    except UnsupportedOperatorException:
        raise NotImplementedError(
            f"{name} has no fake (meta) kernel, so the layout of its result cannot be "
            f"known on the controller; run it on the shards inside a function given to "
            f"mnb.remote(fn, propagate=...) (a propagator, or propagate='cached'), or "
            f"register a fake kernel (torch.library.register_fake)"
        ) from None
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        # the user's error (shapes, dtypes), without FakeTensorMode's frames
        raise type(e)(f"{name}: {e}") from None

    relayout = {}  # input index -> its new layout (an in-place view op: t_(), unsqueeze_())

    def spec(o):
        if o is None:
            return None
        if not isinstance(o, torch.Tensor):
            raise NotImplementedError(f"{name} returns {type(o).__name__} among tensors")
        for i, f in enumerate(fakes):
            if o is f:
                if layout_of(f) != tensors[i]._layout:
                    _tls.fakes = {}  # that fake's layout changed: make new ones
                    if torch.Tag.inplace_view not in func.tags:
                        raise NotImplementedError(
                            f"{name} changes the size of a mesh tensor in place: not supported "
                            f"(use the out-of-place op)"
                        )
                    relayout[i] = layout_of(f)
                return i
        return layout_of(o)

    def base(o):  # the input a new output is a view of (it shares its storage)
        if not isinstance(o, torch.Tensor) or any(o is f for f in fakes):
            return None
        return next((i for i, f in enumerate(fakes) if torch._C._is_alias_of(o, f)), None)

    if isinstance(out, torch.Tensor):
        one = spec(out)
        if relayout:
            return ("relayout", one, relayout[one])
        # a detached copy shares the storage but joins no alias group (docs/api.md)
        return ("one", one, None if func is _DETACH else base(out))
    if isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out):
        return ("many", type(out), [spec(o) for o in out], [base(o) for o in out])
    if out is None:
        return ("one", None, None)
    return ("value", out)
