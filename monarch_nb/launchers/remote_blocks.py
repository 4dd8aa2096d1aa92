"""Where a host agent on another host goes in a mesh: its block of ranks and its
host index (``remote_hosts.AgentChannel`` asks, with its lock held)."""

from __future__ import annotations

import itertools

from .._version import __version__
from ..protocol import host_messages as hm


def place(agents, msg: hm.Hello, world: int) -> tuple[str | None, int]:
    """(why not, first rank) of the block of the agent saying ``msg``, beside ``agents``."""
    n = msg.local_ranks
    if msg.version != __version__:
        return f"the agent runs monarch_nb {msg.version}, this controller {__version__}", 0
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        return f"it offers {n!r} ranks (--local-ranks must be at least 1)", 0
    held = sorted((a.first, a.first + a.count, a) for a in agents)
    if msg.node_rank is not None:
        for a in agents:
            if a.hello.node_rank == msg.node_rank:
                return (
                    f"two host agents claim host slot {msg.node_rank} (--node-rank, "
                    f"SLURM_NODEID or GROUP_RANK): {a.label} holds it",
                    0,
                )
        first = msg.node_rank * n
        if first + n > world:
            return (
                f"host slot {msg.node_rank} x {n} local ranks is ranks {first}-"
                f"{first + n - 1}, beyond the mesh's world of {world}",
                0,
            )
        for lo, hi, a in held:
            if lo < first + n and first < hi:
                return f"its ranks {first}-{first + n - 1} overlap {a.label}'s {lo}-{hi - 1}", 0
        return None, first
    first = 0
    for lo, hi, _ in held:
        if first + n <= lo:
            break
        first = max(first, hi)
    if first + n > world:
        free = world - sum(hi - lo for lo, hi, _ in held)
        return (
            f"it offers {n} ranks, more than the {free} free of the mesh's world of "
            f"{world} ({len(held)} host agent(s) hold the others)",
            0,
        )
    return None, first


def host_slot(agents, msg: hm.Hello, first: int, world: int) -> int:
    """The host index of the agent saying ``msg`` (its block at ``first``): its
    ``--node-rank``, else its block's index; an index held already (blocks of other
    sizes) gives the first free one from the world's size on."""
    want = msg.node_rank if msg.node_rank is not None else first // msg.local_ranks
    taken = {a.slot for a in agents}
    if want not in taken:
        return want
    return next(i for i in itertools.count(world) if i not in taken)


def place_held(agents, msg: hm.Hello, world: int, rejoin: bool) -> tuple[str | None, int, int]:
    """(why not, first rank, host index) of a relay that kept its block running
    (``msg.held``: first, count, host index) while no controller was there."""
    try:
        first, count, slot = (int(v) for v in msg.held)
    except (TypeError, ValueError):
        return f"it holds {msg.held!r}, not a block of ranks", 0, 0
    if not rejoin:
        return (
            "it kept ranks of a mesh whose controller went; this controller started the "
            "mesh and has lost them (a relay that kept its ranks joins a controller that "
            "attaches)", 0, 0,
        )  # fmt: skip
    if msg.version != __version__:
        return f"the agent runs monarch_nb {msg.version}, this controller {__version__}", 0, 0
    if count != msg.local_ranks or first < 0 or first + count > world:
        return f"its block {first}-{first + count - 1} is not of the mesh's world of {world}", 0, 0
    for a in agents:
        if a.first < first + count and first < a.first + a.count:
            return f"its ranks {first}-{first + count - 1} overlap {a.label}'s", 0, 0
    if slot < 0:
        slot = host_slot(agents, msg, first, world)
    elif any(a.slot == slot for a in agents):
        return f"two host agents claim host {slot}", 0, 0
    return None, first, slot
