"""The records of completion and inspection on a rank (worker/shell_handlers.py,
monarch_nb/api/completion.py), and of the user's code files that travel to ranks
on hosts that do not share the controller's filesystem (api/code_sync.py).

They are messages like those of ``messages`` (which imports them, and whose name
they carry, so the wire's codes and the handler tables include them); they live
here to keep that module under 400 lines.
"""

from __future__ import annotations

from typing import NamedTuple

from .receivers import WORKER, sent_to

_MESSAGES = "monarch_nb.protocol.messages"


@sent_to(WORKER)
class Complete(NamedTuple):
    """Answer off the streams: a FetchResult of what the rank's IPython Completer
    offers at ``cursor_pos`` of ``code`` (a complete_reply's content)."""

    ident: int
    code: str
    cursor_pos: int


@sent_to(WORKER)
class Inspect(NamedTuple):
    """Answer off the streams: a FetchResult of the rank's help on the name at
    ``cursor_pos`` of ``code`` (an inspect_reply's content)."""

    ident: int
    code: str
    cursor_pos: int
    detail_level: int


@sent_to(WORKER)
class SyncFiles(NamedTuple):
    """Write the user's changed sources into the mesh's code folder ``folder`` (a
    name, under the rank's temporary directory, first on its ``sys.path``), before
    the command that follows: ``files`` are ``(path under it, sha256 hex, bytes, the
    controller's file)``."""

    folder: str
    files: tuple


Complete.__module__ = Inspect.__module__ = SyncFiles.__module__ = _MESSAGES
