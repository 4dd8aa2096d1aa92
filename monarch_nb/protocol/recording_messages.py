"""The records of ``mnb.compile``'s recordings (recording.py on the controller,
worker/recording.py on the workers).

They are messages like those of ``messages`` (which imports them, and whose name
they carry, so the wire's codes and the handler tables include them); they live
here to keep that module under 400 lines.
"""

from __future__ import annotations

from typing import NamedTuple

from .receivers import WORKER, sent_to

_MESSAGES = "monarch_nb.protocol.messages"


@sent_to(WORKER)
class DefineRecording(NamedTuple):
    """Commands captured by ``mnb.compile`` (those that concern the receiving rank): a
    command message, or a tensor op as its RunOps entry ``(ident, result, op, refs,
    stream, scalars)``. ``floats_at``: per command, where its lifted floats (a tensor
    op's ``scalars``) start in a call's ``floats``, or -1."""

    recording: int
    name: str
    commands: tuple
    floats_at: tuple


@sent_to(WORKER)
class CallRecording(NamedTuple):
    """Replay: ``inputs`` (recorded id, actual id) pairs, ``results`` (recorded, new);
    ``floats``: this call's lifted floats (empty: the recorded ones)."""

    ident: int
    recording: int
    inputs: tuple
    results: tuple
    floats: tuple


@sent_to(WORKER)
class DeleteRecording(NamedTuple):
    """A recording that will not be called again: free it."""

    recording: int


DefineRecording.__module__ = CallRecording.__module__ = DeleteRecording.__module__ = _MESSAGES
