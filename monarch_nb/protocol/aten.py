"""Worker side of mesh tensors: an aten op called by its qualified name.

torch's OpOverload objects do not pickle, so the controller sends the name
("aten::add.Tensor") and ``run_op`` resolves it once per worker process.
"""

from __future__ import annotations

_ops: dict = {}


def resolve_op(name: str):
    """The OpOverload called ``name`` ("ns::op" for the default overload, "ns::op.overload")."""
    import torch

    ns, sep, rest = name.partition("::")
    if not sep or not rest:
        raise ValueError(f"not an operator name: {name!r} (expected 'ns::op.overload')")
    base, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, ns), base), overload or "default")


def run_op(name: str, *args, **kwargs):
    """Run the op ``name`` on this rank's shards (the arguments' Refs resolved)."""
    op = _ops.get(name)
    if op is None:
        op = _ops[name] = resolve_op(name)
    return op(*args, **kwargs)


def alias_after(value, mutated):
    """``value`` itself, once ``mutated`` (an in-place op on storage it shares) has
    run: the new name of a view fails when that op failed."""
    return value


def layout(value) -> tuple:
    """The layout of a worker's tensor, as the controller's mesh tensors keep it."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(value).__name__}")
    return (
        tuple(value.shape),
        tuple(value.stride()),
        value.storage_offset(),
        value.dtype,
        value.device,
    )


def manual_seed(seed: int) -> None:
    """Seed this rank's torch generators (CPU, and CUDA where there is one)."""
    import torch

    torch.manual_seed(seed)
