"""What the controller and a host agent tell each other, as plain typed records.

One JSON object per line: ``{"t": "Spawn", ...fields}``. No pickle: the channel
carries only these records (bytes travel as base64), so a damaged or foreign
line is refused with its reason, never executed. ``slot`` is the controller's
name for one fork request (unique per agent); ranks are the mesh's.
"""

from __future__ import annotations

import base64
import json
from typing import NamedTuple

from .receivers import (
    AGENT,
    AGENT_CHANNEL,
    AGENT_DOOR,
    AGENT_LINK,
    AGENT_RANKS,
    AGENT_RELAY,
    sent_to,
)

# ---------------------------------------------------------------- controller -> agent


@sent_to(AGENT, AGENT_RELAY)
class Spawn(NamedTuple):
    """Fork one rank: it joins ``address`` with ``key_hex`` as ``rank`` of ``world``,
    with exactly ``env`` as its environment, ``sys_path`` as its sys.path and
    ``cwd`` as its working directory (the controller's, now)."""

    slot: int
    rank: int
    world: int
    local_rank: int
    address: str
    key_hex: str
    env: dict
    sys_path: list
    cwd: str
    host: int = -1  # the mesh's index of this host (a simulated host's channel joins as it)


@sent_to(AGENT, AGENT_RELAY)
class Kill(NamedTuple):
    """Send ``sig`` to the rank of ``slot`` (its process group)."""

    slot: int
    sig: int


@sent_to(AGENT, AGENT_RELAY)
class Quit(NamedTuple):
    """Kill every rank and exit."""


@sent_to(AGENT_DOOR)
class Attach(NamedTuple):
    """The first line on a kept-alive mesh's door (``mnb.attach``): controller
    ``pid`` takes the mesh; with ``steal``, from the controller that has it."""

    pid: int
    steal: bool = False


@sent_to(AGENT_LINK)
class Detach(NamedTuple):
    """Another controller (``pid``) took the mesh (``attach(steal=True)``): this one
    lets go of it (the ranks stay)."""

    pid: int


# ---------------------------------------------------------------- agent -> controller


@sent_to(AGENT_LINK, AGENT_CHANNEL)
class AgentReady(NamedTuple):
    """The agent has imported what ranks need and takes Spawns."""

    pid: int
    host: str
    version: str
    local_ranks: int


@sent_to(AGENT_LINK, AGENT_CHANNEL, AGENT_RANKS)
class Spawned(NamedTuple):
    slot: int
    pid: int


@sent_to(AGENT_LINK, AGENT_CHANNEL, AGENT_RANKS)
class SpawnFailed(NamedTuple):
    """The fork of ``slot`` did not happen: ``error`` says why."""

    slot: int
    error: str


@sent_to(AGENT_LINK, AGENT_CHANNEL, AGENT_RANKS)
class Output(NamedTuple):
    """Bytes the rank of ``slot`` wrote to its stdout/stderr (base64)."""

    slot: int
    data: str


@sent_to(AGENT_LINK, AGENT_CHANNEL, AGENT_RANKS)
class Exited(NamedTuple):
    """The rank of ``slot`` ended: ``code`` as Popen's returncode (-N: signal N).
    Sent after the output it wrote before it ended."""

    slot: int
    pid: int
    code: int


@sent_to(AGENT_LINK, AGENT_CHANNEL)
class Held(NamedTuple):
    """After AgentReady, to a controller that attached: the ranks the agent runs,
    ``[slot, rank, pid]`` each."""

    ranks: list


@sent_to(AGENT_LINK, AGENT_CHANNEL, AGENT_RELAY)
class Refused(NamedTuple):
    """The agent could not read a line it was sent (or, from a controller to a
    relay, why the agent is not taken)."""

    error: str


# ---------------------------------------------------------------- relay <-> controller
# (``monarch-nb-host --connect``: the relay's own records; they never reach the agent)


@sent_to(AGENT_CHANNEL)
class Hello(NamedTuple):
    """A relay joins: its host, pid and release, the ranks its agent offers and
    the host slot it claims (``node_rank``; None: the next free block). ``held``:
    ``[first, count, host index]`` of the block it kept running while no controller
    was there (a kept-alive mesh's relay, to a controller that attached)."""

    host: str
    pid: int
    version: str
    local_ranks: int
    node_rank: int | None
    held: list | None = None


@sent_to(AGENT_RELAY)
class Welcome(NamedTuple):
    """The controller took the agent: ranks ``first`` .. ``first + count - 1`` of
    ``world``. ``keep_alive``: seconds the relay keeps them running, waiting for
    another controller, once this one is gone (None: they end with it)."""

    first: int
    count: int
    world: int
    keep_alive: float | None = None


@sent_to(AGENT_CHANNEL, AGENT_RELAY)
class Beat(NamedTuple):
    """A heartbeat, both ways: a side silent for its heartbeat timeout is gone."""


@sent_to(AGENT_CHANNEL)
class AgentGone(NamedTuple):
    """The relay's agent ended (``code`` as Popen's returncode): its ranks died with it."""

    code: int


TYPES = {
    cls.__name__: cls
    for cls in (
        Spawn,
        Kill,
        Quit,
        AgentReady,
        Spawned,
        SpawnFailed,
        Output,
        Exited,
        Refused,
        Attach,
        Detach,
        Held,
        Hello,
        Welcome,
        Beat,
        AgentGone,
    )
}


class HostMessageError(ValueError):
    """A line that is not one of the records above."""


def encode(msg) -> bytes:
    """``msg`` as one line (with its newline)."""
    return json.dumps({"t": type(msg).__name__, **msg._asdict()}).encode() + b"\n"


def decode(line: bytes):
    """The record of ``line``; HostMessageError naming what is wrong."""
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise HostMessageError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise HostMessageError("not a JSON object")
    cls = TYPES.get(obj.pop("t", None))
    if cls is None:
        raise HostMessageError(f"unknown record type in {line[:80]!r}")
    try:
        return cls(**obj)
    except TypeError as e:
        raise HostMessageError(f"{cls.__name__}: {e}") from None


def output(slot: int, data: bytes) -> Output:
    return Output(slot, base64.b64encode(data).decode("ascii"))


def output_bytes(msg: Output) -> bytes:
    return base64.b64decode(msg.data)


class LineReader:
    """Splits what arrives on a byte stream into records."""

    MAX_LINE = 64 << 20

    def __init__(self):
        self._buf = b""

    def feed(self, data: bytes) -> list:
        """The complete lines of ``data`` (and of what came before) as records, or
        HostMessageError instances for lines that are not records."""
        self._buf += data
        if b"\n" not in data:
            if len(self._buf) > self.MAX_LINE:
                self._buf = b""
                return [HostMessageError(f"a line longer than {self.MAX_LINE} bytes")]
            return []
        *lines, self._buf = self._buf.split(b"\n")
        out = []
        for line in lines:
            if line.strip():
                try:
                    out.append(decode(line))
                except HostMessageError as e:
                    out.append(e)
        return out
