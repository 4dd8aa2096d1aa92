"""Borrows of mesh tensors: one stream's tensor used on another, and the rules
that keep the two streams from racing on it.

``stream.borrow(t, mutable=False)`` returns ``(t_on_stream, borrow)``. While the
borrow is live, the tensor's own stream may read ``t`` but not write it; the
borrowing stream may read ``t_on_stream`` and write it only with
``mutable=True``, and then ``t``'s own stream may not even read it.
``borrow.drop()`` (or deleting ``t_on_stream``) gives it back. The worker
orders the streams (its first use waits for the producer; the drop lets the
source go on); the controller refuses, at the call, the ops that would race.
"""

from __future__ import annotations

import weakref

from ...protocol.wire import RefUseError

live = [0]  # borrows not dropped yet: with none, dispatch checks nothing


class Borrow:
    """A live loan of a mesh tensor to another stream; ``drop()`` ends it."""

    def __init__(self, source, borrowed, mutable: bool):
        self._source = weakref.ref(source)
        self._borrowed = weakref.ref(borrowed)
        self.mutable = mutable
        self.stream = borrowed.stream

    @property
    def dropped(self) -> bool:
        t = self._borrowed()
        return t is None or t._deleted

    def drop(self) -> None:
        """Give the tensor back to its stream (after the borrower's work on it)."""
        t = self._borrowed()
        if t is not None:
            t.delete()

    def __repr__(self) -> str:
        state = "dropped" if self.dropped else "live"
        return f"<Borrow on stream {self.stream.name!r}, mutable={self.mutable}, {state}>"


def lend(source, borrowed, mutable: bool) -> Borrow:
    """Record that ``borrowed`` (on another stream) is ``source`` lent out."""
    b = Borrow(source, borrowed, mutable)
    borrowed._loan = b
    lent = source.__dict__.setdefault("_lent", [])
    lent[:] = [x for x in lent if not x.dropped]
    lent.append(b)
    live[0] += 1
    return b


def returned(borrowed) -> None:
    """``borrowed`` was deleted: its loan is over."""
    if getattr(borrowed, "_loan", None) is not None:
        live[0] = max(0, live[0] - 1)


def check(name: str, tensors: list, written: tuple) -> None:
    """Refuse an op that reads ``tensors`` and writes ``tensors[i]`` for i in
    ``written`` if it would race with a live borrow."""
    for i, t in enumerate(tensors):
        for b in t.__dict__.get("_lent", ()):
            if b.dropped:
                continue
            if i in written:
                raise RefUseError(
                    f"{name} writes a tensor that is borrowed by stream {b.stream.name!r}: its "
                    f"own stream {t.stream.name!r} may not write it until the borrow is "
                    f"dropped (borrow.drop())"
                )
            if b.mutable:
                raise RefUseError(
                    f"{name} reads a tensor that stream {b.stream.name!r} borrowed with "
                    f"mutable=True: its own stream {t.stream.name!r} may not use it until the "
                    f"borrow is dropped (borrow.drop())"
                )
        loan = t.__dict__.get("_loan")
        if loan is not None and i in written and not loan.mutable:
            raise RefUseError(
                f"{name} writes a tensor borrowed without mutable=True: on stream "
                f"{t.stream.name!r} it is read-only (stream.borrow(t, mutable=True) to write it)"
            )
