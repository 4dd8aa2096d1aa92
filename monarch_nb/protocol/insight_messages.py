"""The records of the timeline, memory and profiler reports (controller/timeline.py,
worker/insight_handlers.py).

They are messages like those of ``messages`` (which imports them, and whose name
they carry, so the wire's codes and the handler tables include them); they live
here to keep that module under 400 lines.
"""

from __future__ import annotations

from typing import NamedTuple

from .receivers import CONTROLLER, WORKER, sent_to

_MESSAGES = "monarch_nb.protocol.messages"


@sent_to(CONTROLLER)
class Timings(NamedTuple):
    """Worker -> controller, with its progress: the commands finished since the last
    report, per stream ``(stream id, idents, whats, starts, ends)`` (tuples of equal
    length; start and end on the worker's wall clock, seconds)."""

    rank: int
    streams: tuple


@sent_to(WORKER)
class ReadClock(NamedTuple):
    """Answer at once: a FetchResult of the worker's wall clock (``time.time()``)."""

    ident: int


@sent_to(WORKER)
class ReadMemory(NamedTuple):
    """Answer at once: a FetchResult of the rank's memory (``worker/memory.py``); with
    ``snapshot``, the CUDA allocator's snapshot (``torch.cuda.memory._snapshot()``)."""

    ident: int
    snapshot: bool


@sent_to(WORKER)
class StartProfile(NamedTuple):
    """Start torch.profiler (every thread; CUDA activities where present) at once."""

    ident: int


@sent_to(WORKER)
class StopProfile(NamedTuple):
    """Stop the profiler started by StartProfile; answered at once by a FetchResult
    of its Chrome trace (JSON text) or why there is none."""

    ident: int


Timings.__module__ = ReadClock.__module__ = ReadMemory.__module__ = _MESSAGES
StartProfile.__module__ = StopProfile.__module__ = _MESSAGES

# the name of the event a rank's profiler records with a known wall-clock time, so
# that the controller can place its trace on its own clock (controller/profiles.py)
PROFILE_CLOCK_MARK = "monarch_nb.clock"
