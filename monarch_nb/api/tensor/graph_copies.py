"""Copies a compiled graph can do without: ``copy(empty_like(a), b)`` where ``b``
already has the layout ``empty_like`` would give, and nothing else sees ``b``.

AOTAutograd writes torch's gradient accumulation that way (a new ``.grad`` takes the
parameter's layout): in the LM step, 60 of its 600 ops, about a tenth of a rank's
time on the graph. Where ``b`` has that layout (sizes, strides, dtype, device), owns
its whole storage, and shares it with no input and no other output of the graph,
the copy's result cannot be told from ``b``: the graph returns or reads ``b``.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

_copy = torch.ops.aten.copy.default
_empty_like = torch.ops.aten.empty_like.default


def drop_layout_copies(gm: torch.fx.GraphModule) -> int:
    """Remove from ``gm`` each copy into a fresh ``empty_like`` that changes nothing
    (see the module's docstring); returns how many were removed."""
    graph = gm.graph
    output = next(iter(graph.find_nodes(op="output")))
    kept = _storages(graph.find_nodes(op="placeholder"))
    outputs = [n for n in output.args[0] if isinstance(n, torch.fx.Node)]
    dropped = 0
    for node in list(graph.find_nodes(op="call_function", target=_copy)):
        if len(node.args) != 2 or node.kwargs:
            continue
        dst, src = node.args
        if not (_fresh(dst) and isinstance(src, torch.fx.Node) and _same_layout(dst, src)):
            continue
        others = [n for n in outputs if n is not node]
        if _storage(src) in kept | _storages(others) or not _whole(src):
            continue
        node.replace_all_uses_with(src)
        graph.erase_node(node)
        if not dst.users:
            graph.erase_node(dst)
        outputs = [src if n is node else n for n in outputs]
        dropped += 1
    if dropped:
        gm.recompile()
    return dropped


def _val(node):
    """The node's example value, where its layout is plain numbers (a symbolic size is
    not compared here: that would add a guard dynamo never checks)."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    numbers = (*val.shape, *val.stride(), val.storage_offset(), val.untyped_storage().nbytes())
    return val if all(type(d) is int for d in numbers) else None


def _fresh(node) -> bool:
    """An ``empty_like`` read by one copy alone, in the input's own layout."""
    return (
        isinstance(node, torch.fx.Node)
        and node.target is _empty_like
        and len(node.users) == 1
        and set(node.kwargs) <= {"pin_memory", "dtype", "layout", "device"}
        and not node.kwargs.get("pin_memory")
    )


def _same_layout(a, b) -> bool:
    x, y = _val(a), _val(b)
    return (
        x is not None
        and y is not None
        and x.shape == y.shape
        and x.stride() == y.stride()
        and x.dtype == y.dtype
        and x.device == y.device
        and x.layout == y.layout == torch.strided
    )


def _whole(node) -> bool:
    """Its value spans its whole storage from offset 0, as a new tensor does."""
    v = _val(node)
    if v is None or v.storage_offset() != 0:
        return False
    # its strides are empty_like's, dense: its bytes are then the storage's whole
    return v.untyped_storage().nbytes() == v.numel() * v.element_size()


def _storage(node):
    v = _val(node)
    return StorageWeakRef(v.untyped_storage()) if v is not None else None


def _storages(nodes) -> set:
    return {s for s in map(_storage, nodes) if s is not None}
