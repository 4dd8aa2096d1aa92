"""Worker side of mesh tensors' autograd: each rank builds the graph of its shards.

An op runs on each rank in the grad mode it ran in on the controller, and its
inputs that require grad there require grad on the rank too (a leaf shard
starts to), while any other input that requires grad on the rank is detached
(``requiring``, ``run_grad``). So every rank holds the graph the controller
holds, over its own shards, and no other. A ``loss.backward()`` is then one
command (``backward_shards``): each rank runs torch's engine on its graph, and
the controller names the leaves' new grads.
"""

from __future__ import annotations

import torch

from .aten import op_named

_set_grad = torch._C._set_grad_enabled
_grad_on = torch.is_grad_enabled


def requiring(values: list, grad: tuple) -> list:
    """``values`` with those at ``grad`` requiring grad (a leaf shard starts to) and
    every other tensor that requires grad here detached (the controller's graph does
    not go through it, so this rank's must not)."""
    out = list(values)
    for j, v in enumerate(values):
        if not isinstance(v, torch.Tensor):
            continue
        if j in grad:
            if not v.requires_grad:
                v.requires_grad_(True)
        elif v.requires_grad:
            out[j] = v.detach()
    return out


def run_grad(fn, grad, args: list, kwargs: dict):
    """``fn(*args, **kwargs)`` in grad mode when ``grad`` is a tuple (the tensor slots
    that require grad, already applied by ``requiring``), else in no_grad."""
    was = _grad_on()
    _set_grad(grad is not None)
    try:
        return fn(*args, **kwargs)
    finally:
        _set_grad(was)


def tensors_in(args: tuple, kwargs: dict) -> list:
    """The tensors of an op's arguments in the order the controller's plan key met
    them: keyword arguments first, then positional, lists and tuples walked."""
    found: list = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif type(x) in (list, tuple):
            for y in x:
                walk(y)

    for v in kwargs.values():
        walk(v)
    for v in args:
        walk(v)
    return found


def replace_tensors(args: tuple, kwargs: dict, new: list) -> tuple:
    """``(args, kwargs)`` with their tensors (in ``tensors_in``'s order) replaced by ``new``."""
    it = iter(new)

    def put(x):
        if isinstance(x, torch.Tensor):
            return next(it)
        if type(x) in (list, tuple):
            return type(x)(put(y) for y in x)
        return x

    kw = {k: put(v) for k, v in kwargs.items()}
    return tuple(put(a) for a in args), kw


def run_op_grad(grad: tuple, name: str, *args, **kwargs):
    """``aten.run_op`` with autograd: the tensors of its arguments at ``grad`` (in
    ``tensors_in``'s order) require grad."""
    found = tensors_in(args, kwargs)
    args, kwargs = replace_tensors(args, kwargs, requiring(found, grad))
    return run_grad(op_named(name), grad, args, kwargs)


def saved_copy(value):
    """torch's copy of a tensor autograd saves (or unpacks): on a rank the tensor
    itself, so that a graph built on the copy (double backward) goes through it."""
    return value


def detached(value):
    """A shard's ``detach_()`` here: its alias without this rank's graph (a leaf)."""
    return value.detach()


def data_set(value, new):
    """A shard's ``t.data = new`` here: ``value`` (same object, graph, grad) now holds
    ``new``'s storage and layout."""
    value.data = new
    return value


def shard_value(value):
    """A shard as a fetch sends it: its value, without this rank's graph."""
    return value.detach() if isinstance(value, torch.Tensor) and value.requires_grad else value


def backward_shards(spec: tuple, *values):
    """One ``loss.backward()`` on this rank: ``spec`` is ``(has_gradient, retain_graph,
    leaves)``, each leaf ``(has_grad, size, stride)``; ``values`` are the loss, the
    gradient (if any), the leaves' shards, then the grads they have on the controller.
    Each leaf's ``.grad`` is set to the controller's first, then the engine runs;
    returns the leaves' grads (each of the layout the controller gave it)."""
    has_gradient, retain, leaves = spec
    loss = values[0]
    at = 1
    gradient = values[1] if has_gradient else None
    at += has_gradient
    shards = values[at : at + len(leaves)]
    grads = iter(values[at + len(leaves) :])
    for shard, (has_grad, _, _) in zip(shards, leaves):
        shard.grad = next(grads) if has_grad else None
    if not loss.requires_grad:
        raise RuntimeError(
            "this rank holds no autograd graph for the tensor whose backward() was "
            "called: an op on its way did not run with autograd here"
        )
    torch.autograd.backward(loss, gradient, retain_graph=retain)
    missed = [tuple(s.shape) for s in shards if s.grad is None]
    if missed:  # else the controller would name a grad this rank does not hold
        raise RuntimeError(
            f"this rank's backward gave {len(missed)} of the graph's leaves no gradient "
            f"(shapes {', '.join(map(str, missed[:4]))}), which the controller's graph "
            f"reaches: its graph differs from this rank's; torch.autograd.backward(loss) "
            f"runs torch's engine on the controller instead"
        )
    out = []
    for shard, (_, size, stride) in zip(shards, leaves):
        g = shard.grad
        if g is not None and (tuple(g.stride()) != stride or g.storage_offset() != 0):
            g = torch.empty_strided(size, stride, dtype=g.dtype, device=g.device).copy_(g)
            shard.grad = g
        out.append(g)
    return tuple(out)
