"""Taking over the running workers of a kept-alive mesh (``mnb.attach``), and
letting go of a mesh without stopping them.

The new controller listens where the old one did, with the mesh's key; each
rank's connection comes back on its own and its receiver says WorkerRejoined:
its streams, and how far it has counted ids and command idents (this
controller counts on from the highest). The values the old controller held are
unreachable now and freed; what the user's code bound in the workers' namespace
stays (``mesh.tensor(name)``, ``mesh.fetch(name)``).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from ..protocol import messages as m
from .errors import MeshClosedError


@dataclass
class Rejoin:
    """What a controller needs to take a kept-alive mesh over."""

    secret: bytes  # the mesh's key
    port: int  # where its ranks reconnect
    procs: dict | None  # rank -> process handle (the agent's AgentRank); None: the launcher's ``held``


def rejoin_generation(ctrl, rejoin: Rejoin, timeout: float) -> None:
    """Wait until every rank of ``ctrl`` rejoined (within ``timeout`` s), then take
    their state; on failure let go of the mesh (its ranks untouched) and raise."""
    workers = ctrl.workers
    workers.procs, workers.rejoined = dict(rejoin.procs or {}), {}
    ctrl.peers.resume(range(ctrl.world))  # before the first message is read
    ctrl.io.start()
    deadline = time.monotonic() + timeout
    try:
        if rejoin.procs is None:  # agents on other hosts: they come back, and say what they hold
            workers.procs = workers.launcher.held(ctrl.address, rejoin.secret, ctrl.world, timeout)
        while not workers.ready.wait(0.05):
            gone = [r for r, p in workers.procs.items() if p.poll() is not None]
            if gone or time.monotonic() > deadline:
                why = f"rank(s) {gone} ended" if gone else f"not within {timeout:.0f} s"
                tails = "".join(f"\n[rank {r}] {workers.procs[r].tail_text()}" for r in gone)
                raise TimeoutError(
                    f"mesh {ctrl.name!r}: ranks {workers.missing()} did not come back "
                    f"({why}){tails}"
                )
        if workers.startup_error is not None:
            raise workers.startup_error
    except BaseException:
        let_go(ctrl, "the attach failed")
        raise
    infos = list(workers.rejoined.values())
    workers.rejoined = None  # from now on a rank that reconnects is one of ours (replies.py)
    ctrl._ids = itertools.count(max(i.high_id for i in infos) + 1)
    ctrl._idents = itertools.count(max(i.high_ident for i in infos) + 1)
    for info in infos:
        for sid, name in info.streams.items():
            if sid != 0 and name not in ctrl.streams:
                ctrl.streams[name] = sid
                ctrl.state.add_stream(sid, name)
    ctrl.state.backend = next((i.backend for i in infos if i.backend), ctrl.state.backend)
    stores = [i.store_generation for i in infos if i.store_generation is not None]
    if stores:  # the ranks create process groups through their generation's store
        ctrl.rendezvous.serve(stores[0])
    ctrl.send(m.ForgetDefinitions(), [i.rank for i in infos])  # the old controller's ops
    for info in infos:
        if info.refs:
            ctrl.send(m.DeleteRefs(tuple(info.refs)), [info.rank])


def let_go(ctrl, why: str) -> None:
    """``Controller.detach``: stop driving the mesh and leave its workers running
    (a kept-alive mesh's agent waits for another controller). Calls waiting on it,
    and every later one, raise MeshClosedError saying ``why``."""
    with ctrl._lifecycle:
        if ctrl._closed:
            return
        ctrl._closing = True
        ctrl.closed_why = f"mesh {ctrl.name!r} was let go of: {why}"
        ctrl.fail_requests(MeshClosedError(ctrl.closed_why))
        ctrl._closed = True
        ctrl.io.stop()  # its port is free before the agent hears from us: for a stealer
        ctrl.workers.launcher.let_go()
        ctrl.rendezvous.let_go()  # the ranks go on using its store
