"""What callers hand the IO loop (``IOLoop.submit``), one small record per kind, and
the callbacks the loop is built with (``IOCallbacks``)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, NamedTuple


class Send(NamedTuple):
    """Send ``frames`` to ``ranks``; ``done`` (a Future or None) gets the ZeroMQ
    tracker of a big zero-copy send."""

    ranks: Any
    frames: list
    done: Future | None = None


class SendRequest(NamedTuple):
    """A request (someone waits for its replies): registered by the lease holder
    (``IOCallbacks.on_request``), then its frames leave as a ``Send``'s do."""

    request: Any
    ranks: Any
    frames: list


class CancelRequest(NamedTuple):
    """Drop ``request`` from the table and cancel its commands on the workers."""

    request: Any


class Op(NamedTuple):
    """A tensor op's fields (a RunOps entry) for ``ranks``: encoded with its neighbours
    into one RunOps."""

    ranks: Any
    fields: tuple


class Delete(NamedTuple):
    """A freed value, announced after the batch it came with."""

    ref_id: int


class Raw(NamedTuple):
    """Frames sealed already, to one socket (the agents' channel)."""

    identity: bytes
    frames: list


class Call(NamedTuple):
    """Run ``fn`` on the IO thread; ``future`` gets its value."""

    fn: Callable[[], Any]
    future: Future


def op(ranks, fields: tuple, _new=tuple.__new__) -> Op:
    """``Op(ranks, fields)`` at a plain tuple's cost (one per tensor op: the hot path)."""
    return _new(Op, (ranks, fields))


class IOCallbacks(NamedTuple):
    """What the IO loop calls, given when it is made. Each runs on the lease holder's
    thread (the IO thread, or a caller driving the socket while it waits)."""

    on_frames: Callable[[list], None]  # a frame set from a worker or host socket
    on_tick: Callable[[], None]  # every TICK s: process checks, housekeeping
    on_request: Callable[[Any], None]  # a SendRequest's request: register it
    on_cancel: Callable[[Any], None]  # a CancelRequest's request
    on_process_output_end: Callable[[Any], None]  # a watched process closed its output
    encode_deletes: Callable[[tuple], Any]  # ref ids -> the frames of one DeleteRefs, or None
    encode_ops: Callable[[list], Any]  # RunOps entries -> the frames of one RunOps
    encode_host_command: Callable[[tuple, int], Any]  # (targets, count) -> frames
    seal: Callable[[Any, int, bytes], Any]  # (frames, count, identity) -> sealed frames
