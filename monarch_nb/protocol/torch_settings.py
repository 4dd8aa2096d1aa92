"""torch's process-wide settings that change what an op computes, or how fast: the
controller's are carried to the ranks (``api/tensor/defaults.py``), which set them
here (``apply``).

Each is read with its C getter (~0.5 us for all, before every mesh op). TF32 is read
through the API most scripts use (``torch.set_float32_matmul_precision``,
``torch.backends.cuda.matmul.allow_tf32``, ``torch.backends.cudnn.allow_tf32``).
torch's newer per-backend ``fp32_precision`` API keeps a state of its own that the old
getters refuse to read once it was used; a process using it has those two fields read
as None: the ranks keep theirs.
"""

from __future__ import annotations

import torch

_C = torch._C

NAMES = (
    "torch.set_default_dtype",
    "torch.use_deterministic_algorithms",
    "torch.use_deterministic_algorithms(warn_only=)",
    "torch.utils.deterministic.fill_uninitialized_memory",
    "torch.backends.cudnn.benchmark",
    "torch.backends.cudnn.deterministic",
    "torch.set_float32_matmul_precision",
    "torch.backends.cudnn.allow_tf32",
)
FRESH = (torch.float32, False, False, True, False, False, "highest", True)  # a new process's


def read() -> tuple:
    """This process's settings, in the order of NAMES."""
    try:
        tf32 = (_C._get_float32_matmul_precision(), _C._get_cudnn_allow_tf32())
    except RuntimeError:  # the fp32_precision API was used: the old getters refuse
        tf32 = (None, None)
    return (
        torch.get_default_dtype(),
        _C._get_deterministic_algorithms(),
        _C._get_deterministic_algorithms_warn_only(),
        _C._get_deterministic_fill_uninitialized_memory(),
        _C._get_cudnn_benchmark(),
        _C._get_cudnn_deterministic(),
        *tf32,
    )


def _deterministic(on: bool) -> None:
    torch.use_deterministic_algorithms(on, warn_only=_C._get_deterministic_algorithms_warn_only())


def _warn_only(on: bool) -> None:
    torch.use_deterministic_algorithms(_C._get_deterministic_algorithms(), warn_only=on)


def _fill(on: bool) -> None:
    torch.utils.deterministic.fill_uninitialized_memory = on


# torch.backends.cudnn's attributes refuse a write once torch's test utilities have
# called disable_global_flags (their flags() writes through these C setters)
_SETTERS = (
    torch.set_default_dtype,
    _deterministic,
    _warn_only,
    _fill,
    _C._set_cudnn_benchmark,
    _C._set_cudnn_deterministic,
    torch.set_float32_matmul_precision,
    _C._set_cudnn_allow_tf32,
)


def apply(changes: tuple) -> None:
    """Set ``changes`` (``(index into NAMES, value)`` pairs, in that order) here."""
    for i, value in changes:
        _SETTERS[i](value)


def changes_from(held: tuple, now: tuple) -> tuple:
    """The ``(index, value)`` pairs that turn ``held`` into ``now``."""
    return tuple((i, v) for i, (h, v) in enumerate(zip(held, now)) if v != h)
