"""The one value every rank agrees on: what ``t.item()``, ``bool(t)`` and an op whose
result depends on the data (``nonzero``, ``unique``, ``x[mask]``) take from the ranks.

A mesh tensor has one layout on every rank, and a Python value one value: the
ranks are asked (a round trip, as a CUDA tensor's ``item()`` is a sync), and
when they disagree the error names them and how to choose.
"""

from __future__ import annotations

import math

import torch

from ..context import recording_trace


def leave_recording(what: str) -> None:
    """``what`` asks the ranks for values: inside ``mnb.compile`` the call goes on
    uncompiled from here (``Trace.leave``)."""
    trace = recording_trace.active
    if trace is not None:
        trace.leave(what)


def same_value(a, b) -> bool:
    """Equal values (NaN equal to NaN), tensors compared exactly."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if torch.equal(a, b):
            return True
        if a.is_floating_point() or a.is_complex():
            return bool(((a == b) | (a.isnan() & b.isnan())).all())
        return False
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def _shown(v) -> str:
    if isinstance(v, torch.Tensor):
        return repr(v.item()) if v.numel() == 1 else f"a tensor of shape {tuple(v.shape)}"
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def agreed(values: list, ranks, what: str, hint: str):
    """The value of ``values`` (one per rank of ``ranks``) when every rank holds the
    same; else a ValueError naming the ranks that differ and ``hint``."""
    first = values[0]
    differ = [(r, v) for r, v in zip(ranks, values) if not same_value(v, first)]
    if not differ:
        return first
    shown = "; ".join(f"rank {r}: {_shown(v)}" for r, v in [(ranks[0], first), *differ[:3]])
    more = f" (and {len(differ) - 3} more ranks)" if len(differ) > 3 else ""
    raise ValueError(f"{what}: the ranks hold different values ({shown}{more}): {hint}")


def agreed_shard(t, what: str) -> torch.Tensor:
    """``t``'s shard, the same on every rank of its mesh (fetched from each)."""
    leave_recording(what)
    return agreed(
        t.fetch(),
        list(t.mesh.targets),
        what,
        "pick one rank's with mnb.inspect(t, dp=0), or reduce them first "
        "(t.reduce('dp', 'avg'))",
    )
