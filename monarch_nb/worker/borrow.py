"""Borrows: using a value of one stream on another without a race.

The lending stream publishes the value (and, on GPU, an event recorded on its
CUDA stream) when it reaches the borrow in its queue; the borrowing stream's
first use waits for that. When the borrow is dropped, the borrowing stream
hands the value back (with an event) and the lending stream waits for it
before running anything queued after the drop: until then it cannot free or
mutate the value under the borrower.
"""

from __future__ import annotations

import queue

from .ref_cell import Cell

_POLL = 0.05  # waits are sliced so that an interrupt can land


def _get(q: queue.SimpleQueue):
    while True:
        try:
            return q.get(timeout=_POLL)
        except queue.Empty:
            continue


def _cuda_stream(stream):
    """The CUDA stream a worker stream runs its kernels on (None without CUDA).
    Called on that stream's own thread, so the current stream is the right one
    for the default stream."""
    if not stream.worker.cuda:
        return None
    import torch

    return stream.cuda_stream or torch.cuda.current_stream()


def _event(stream):
    cs = _cuda_stream(stream)
    if cs is None:
        return None
    import torch

    e = torch.cuda.Event()
    cs.record_event(e)
    return e


def _wait(stream, event) -> None:
    if event is not None:
        _cuda_stream(stream).wait_event(event)


class Borrow:
    def __init__(self, lender, borrower):
        self.lender = lender
        self.borrower = borrower
        self._lent: queue.SimpleQueue = queue.SimpleQueue()
        self._returned: queue.SimpleQueue = queue.SimpleQueue()
        self._held = None
        self.taken = False

    def create(self, source: Cell) -> None:
        """On the lending stream: publish the value (or its failure)."""
        self._lent.put((_event(self.lender), source.value))

    def first_use(self, result: Cell) -> None:
        """On the borrowing stream: wait for the value, then define ``result``."""
        event, value = _get(self._lent)
        _wait(self.borrower, event)
        self._held = value
        self.taken = True
        result.set(value)

    def last_use(self) -> None:
        """On the borrowing stream: give the value back."""
        if not self.taken:  # never used: take it first so the lender is not left waiting
            event, self._held = _get(self._lent)
            _wait(self.borrower, event)
        self._returned.put((_event(self.borrower), self._held))
        self._held = None

    def drop(self) -> None:
        """On the lending stream: wait until the borrower is done with the value."""
        event, _ = _get(self._returned)
        _wait(self.lender, event)
