"""What a ``Reduce`` message may ask for: the reductions, and which combinations of
``scatter``, ``inplace`` and ``out`` can run. ``Ref.reduce`` checks them before it
sends; the workers check them again (the same on every rank)."""

from __future__ import annotations

REDUCTIONS = ("sum", "avg", "max", "min", "product", "stack")


def check_combination(reduction: str, scatter: bool, inplace: bool, has_out: bool) -> None:
    """Raise ValueError for a combination that cannot be run (the same on every rank)."""
    if inplace and has_out:
        raise ValueError(
            "reduce(): inplace=True and out= both name where the result goes; pass one"
        )
    if inplace and (reduction == "stack") != scatter:
        raise ValueError(
            f"reduction {reduction!r} with scatter={scatter} cannot be in place: the result "
            "has a new shape (only all_reduce and stack with scatter=True keep it)"
        )
