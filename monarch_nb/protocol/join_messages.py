"""A rank's word to a controller that attached to its kept-alive mesh
(``mnb.attach``): what the new controller must know to go on where the old one
stopped, sent by the rank's receiver as its connection comes back. A message like
those of ``messages`` (which imports it, and whose name it carries: the wire's
codes and the handler tables include it)."""

from __future__ import annotations

from typing import NamedTuple

from .receivers import CONTROLLER, WORKER, sent_to

_MESSAGES = "monarch_nb.protocol.messages"


@sent_to(CONTROLLER)
class WorkerRejoined(NamedTuple):
    """As WorkerReady, and: the rank's streams ({id: name}), the highest id (of a
    value, stream, mesh, group, recording, op or pipe) and command ident it has
    seen (the new controller's counters go on above them), its torch.distributed
    backend (None: not started), and the ids of the values the old controller
    held (unreachable now: freed)."""

    rank: int
    world: int
    pid: int
    host: str
    cuda: bool
    streams: dict
    high_id: int
    high_ident: int
    backend: str | None
    refs: tuple
    store_generation: int | None  # of the controller's store it joined through, if any


WorkerRejoined.__module__ = _MESSAGES


@sent_to(WORKER)
class ForgetDefinitions(NamedTuple):
    """From a controller that attached, before any command of its own: drop the tensor
    ops (DefineOp) and recordings (DefineRecording) this rank holds. They are earlier
    controllers' (their commands queued here already hold what they run); no command
    names them again."""


ForgetDefinitions.__module__ = _MESSAGES
