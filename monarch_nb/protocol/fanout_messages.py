"""The records of a host agent's fan-out (host/fanout.py, controller/hosts.py): one
message per host for the ranks it serves, and the folds of their replies.

They are messages like those of ``messages`` (which imports them, and whose name
they carry, so the wire's codes and the handler tables include them); they live
here to keep that module under 400 lines.
"""

from __future__ import annotations

from typing import NamedTuple

from .receivers import CONTROLLER, HOST_LINKS, RELAY, sent_to

_MESSAGES = "monarch_nb.protocol.messages"


@sent_to(RELAY)
class HostCommand(NamedTuple):
    """Controller -> host agent: the next ``count`` messages on the host's socket are
    for each of ``targets`` (ranks the host serves), in the order they come."""

    targets: tuple
    count: int


@sent_to(HOST_LINKS)
class HostJoin(NamedTuple):
    """Host agent -> controller, the first message on a host's socket: it serves the
    ranks of ``host`` (the mesh's host index, sealed as ``envelope.host_peer(host)``)."""

    host: int
    pid: int
    name: str
    version: str


@sent_to(HOST_LINKS)
class Folded(NamedTuple):
    """Host agent -> controller: messages of type ``kind`` from several of its ranks,
    one group per distinct content: ``((ranks, fields without the rank), ...)``."""

    kind: str
    groups: tuple


@sent_to(CONTROLLER)
class RankGap(NamedTuple):
    """Relay -> controller: ``missed`` messages of a socket of ``rank`` never reached it."""

    rank: int
    missed: int


HostCommand.__module__ = HostJoin.__module__ = Folded.__module__ = RankGap.__module__ = _MESSAGES
