"""Worker side of mesh tensors: an aten op called by its qualified name.

torch's OpOverload objects do not pickle, so the controller sends the name
("aten::add.Tensor", ``wire_name``) and ``run_op`` resolves it once per worker
process. An op a Python module defines (``torch.library.custom_op``) travels as
"ns::op from package.module": a worker imports that module to find it.
"""

from __future__ import annotations

import importlib

_ops: dict = {}
# torch's own ops that its Python modules register when imported (a graph of
# torch.compile names them: dynamo writes addcmul with a value as inductor's prims.fma)
_REGISTERED_IN = {
    "prims": ("torch._prims", "torch._inductor.inductor_prims"),
    "rngprims": ("torch._prims.rng_prims",),
}


_BUILT_IN = frozenset(("aten", "prims", "rngprims", "quantized", "_c10d_functional"))
_wire_names: dict = {}


def wire_name(func) -> str:
    """The name ``resolve_op`` takes for OpOverload ``func`` (made on the controller)."""
    name = _wire_names.get(func)
    if name is None:
        name = _wire_names[func] = _with_module(func.name())
    return name


def defining_module(name: str) -> str | None:
    """The importable module whose import defines op ``name`` ("ns::op[.overload]"),
    where torch knows it (``torch.library.custom_op``); None for torch's own ops and
    for ops a notebook defines (``__main__`` is not importable on a worker)."""
    ns, _, rest = name.partition("::")
    if ns in _BUILT_IN:
        return None
    from torch._library.custom_ops import OPDEFS

    init = getattr(OPDEFS.get(f"{ns}::{rest.partition('.')[0]}"), "_init_fn", None)
    module = getattr(init, "__module__", None)
    return module if module and module != "__main__" else None


def _with_module(name: str) -> str:
    module = defining_module(name)
    return name if module is None else f"{name} from {module}"


def resolve_op(name: str):
    """The OpOverload called ``name`` ("ns::op" for the default overload, "ns::op.overload";
    "... from package.module": that module defines it, imported first)."""
    import torch

    name, _, module = name.partition(" from ")
    if module:
        importlib.import_module(module)
    ns, sep, rest = name.partition("::")
    if not sep or not rest:
        raise ValueError(f"not an operator name: {name!r} (expected 'ns::op.overload')")
    base, _, overload = rest.partition(".")
    for module in (None, *_REGISTERED_IN.get(ns, ())):
        if module is not None:
            importlib.import_module(module)
        try:
            return getattr(getattr(getattr(torch.ops, ns), base), overload or "default")
        except AttributeError:
            pass
    raise RuntimeError(
        f"operator {name} is not registered in this worker: an op defined in Python "
        f"(torch.library) exists only where its module was imported (or, for some of "
        f"torch's own, called once); import that module on the workers first (an op "
        f"defined in the notebook: define it in a %%monarch cell too)"
    )


def op_callable(name: str):
    """The C++ callable of the op ``name`` (its OpOverload's ``_op``): a call of it
    skips OpOverload.__call__'s Python frame around it (~0.4 us of ~4 an op)."""
    op = resolve_op(name)
    return getattr(op, "_op", op)


def op_named(name: str):
    """The OpOverload ``name``, resolved once per process."""
    op = _ops.get(name)
    if op is None:
        op = _ops[name] = resolve_op(name)
    return op


def run_op(name: str, *args, **kwargs):
    """Run the op ``name`` on this rank's shards (the arguments' Refs resolved),
    without autograd (``autograd.run_op_grad`` runs one with)."""
    import torch

    with torch.no_grad():
        return op_named(name)(*args, **kwargs)


def alias_after(value, mutated):
    """``value`` itself, once ``mutated`` (an in-place op on storage it shares) has
    run: the new name of a view fails when that op failed."""
    return value


def aliases_after(mutated, *values) -> tuple:
    """``values`` themselves, once ``mutated`` has run: the new names of every tensor
    an op wrote (a foreach op's lists, their views), in one command."""
    return values


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


def rng_state():
    """This rank's CPU generator state (``torch.get_rng_state()`` under a mesh)."""
    import torch

    return torch.default_generator.get_state()


def set_rng_state(state) -> None:
    """Set this rank's CPU generator state (``torch.set_rng_state`` under a mesh)."""
    import torch

    torch.default_generator.set_state(state)


class LayoutMismatchError(RuntimeError):
    """A remote function's result differs from the layout its propagator gave."""


def describe(value):
    """The layout description of a remote function's result: ``("one", layout)``
    for a tensor, ``("many", "tuple" | "list", [layout | None, ...])`` for a
    sequence of tensors (None: not a tensor), ``("value", None)`` otherwise."""
    import torch

    if isinstance(value, torch.Tensor):
        return ("one", layout(value))
    if type(value) in (tuple, list) and value and any(isinstance(v, torch.Tensor) for v in value):
        kind = type(value).__name__
        return ("many", kind, [layout(v) if isinstance(v, torch.Tensor) else None for v in value])
    return ("value", None)


def outcome(value):
    """What an op whose result depends on the data made on this rank: the layout
    description of its tensors (``describe``), or ``("value", value)`` for a Python
    value (``item()``, ``equal``)."""
    desc = describe(value)
    return ("value", value) if desc[0] == "value" else desc


def shown(desc) -> str:
    def one(lay):
        return "no tensor" if lay is None else f"shape {tuple(lay[0])} {lay[3]}"

    if desc[0] == "one":
        return one(desc[1])
    if desc[0] == "many":
        return f"{desc[1]} of [{', '.join(one(x) for x in desc[2])}]"
    return "no tensor"


def _fits(got, want) -> bool:
    """Shapes and dtypes agree (strides may differ: the shard is what it is)."""
    if got[0] != want[0]:
        return False
    if got[0] == "one":
        return tuple(got[1][0]) == tuple(want[1][0]) and got[1][3] == want[1][3]
    if got[0] == "many":
        return len(got[2]) == len(want[2]) and all(
            (a is None) == (b is None)
            and (a is None or (tuple(a[0]) == tuple(b[0]) and a[3] == b[3]))
            for a, b in zip(got[2], want[2])
        )
    return True


def call_checked(function, expected, /, *args, **kwargs):
    """Run ``function`` (a messages.Function, resolved once per payload) on this
    rank's values; its result must fit ``expected`` (the layout description the
    controller built its mesh tensors from), else a LayoutMismatchError naming both."""
    from .pickling import resolve_function

    name = function.name
    out = resolve_function(function)(*args, **kwargs)
    if expected is not None:
        got = describe(out)
        if not _fits(got, expected):
            raise LayoutMismatchError(
                f"{name} returned {shown(got)}, but its propagator said "
                f"{shown(expected)}: the mesh tensors made from it have the wrong "
                f"layout; fix the propagate= function (or use propagate='inspect')"
            )
    return out


class OpSlot:
    """Where an op's ``i``-th value goes among a DefineOp's arguments: its Refs first, then
    its lifted floats (of its RunOps entry)."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i

    def __reduce__(self):
        return (OpSlot, (self.i,))

    def __repr__(self) -> str:
        return f"OpSlot({self.i})"
