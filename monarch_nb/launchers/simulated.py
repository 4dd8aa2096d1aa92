"""SimLauncher: a mesh of light ranks on simulated hosts (``local_mesh(...,
simulate=True)``), to measure the controller at 1,024 ranks on one machine.

Each simulated host is its own agent process (``monarch-nb-host --simulate K``,
no torch) holding K light ranks; every rank still has its own signed ZeroMQ
connection to the controller. The mesh's hosts start at its first launch, stay
for its restarts (a host that died is replaced) and end with the mesh. This
process holds at most ``sim_slots`` (a setting) simulated ranks in all meshes together: a mesh
that would go beyond is refused before anything starts.
"""

from __future__ import annotations

import os
import threading

from .. import config
from ..controller.workers import Launcher
from .host_agent import AgentRank, HostAgent, await_spawned

_held: dict[int, tuple[str, int]] = {}  # id(launcher) -> (mesh name, ranks held)
_held_lock = threading.Lock()


class SimLauncher(Launcher):
    """Light ranks of mesh ``name`` (``world`` of them), ``per_host`` per simulated host."""

    external = False  # the simulated hosts report each rank's end at once

    def __init__(self, name: str, world: int, per_host: int, wrap=None):
        """``wrap(i)``: a command prefix for simulated host ``i`` (a network namespace)."""
        if isinstance(per_host, bool) or not isinstance(per_host, int) or per_host < 1:
            raise ValueError(f"ranks per simulated host must be a positive int, got {per_host!r}")
        self.name, self.world, self.per_host = name, world, per_host
        self.wrap = wrap
        self.agents: list[HostAgent] = []
        ensure_descriptors(world + 3 * self.hosts)
        with _held_lock:
            others = [(n, k) for n, k in _held.values()]
            used = sum(k for _, k in others)
            slots = config.setting("sim_slots")
            if used + world > slots:
                held = ", ".join(f"{n!r}: {k}" for n, k in others) or "none"
                raise ValueError(
                    f"a simulated mesh of {world} ranks does not fit: this process has "
                    f"{slots} simulated rank slots (MONARCH_NB_SIM_SLOTS), {used} held by "
                    f"other meshes ({held}); shut one down or ask for fewer ranks"
                )
            _held[id(self)] = (name, world)

    @property
    def hosts(self) -> int:
        """How many simulated hosts hold the mesh."""
        return -(-self.world // self.per_host)

    def launch(self, address: str, key: bytes, world: int) -> dict[int, AgentRank]:
        self._start_hosts()
        ranks = {
            r: self.agents[r // self.per_host].spawn(
                r, world, address, key, {}, host=r // self.per_host
            )
            for r in range(world)
        }
        await_spawned(ranks, world, self._host_of, "light rank")
        return ranks

    def host_ranks(self, host: int, pid: int) -> range | None:
        """The ranks simulated host ``host`` serves, if ``pid`` is its process (else None)."""
        if not 0 <= host < len(self.agents) or self.agents[host].pid != pid:
            return None
        return range(host * self.per_host, min((host + 1) * self.per_host, self.world))

    def _host_of(self, rank: int) -> str:
        host = self.agents[rank // self.per_host]
        return f"{host.label} (pid {host.pid})"

    def _start_hosts(self) -> None:
        """One agent per simulated host: started in parallel, a dead one replaced."""
        fresh = []
        for i in range(self.hosts):
            if i < len(self.agents) and self.agents[i].alive:
                continue
            per_host = min(self.per_host, self.world - i * self.per_host)
            prefix = self.wrap(i) if self.wrap is not None else ()
            agent = HostAgent(wait=False, simulate=per_host, host_name=f"sim-{i}", prefix=prefix)
            if i < len(self.agents):
                self.agents[i] = agent
            else:
                self.agents.append(agent)
            fresh.append(agent)
        for agent in fresh:
            agent.wait_ready()

    def pids(self) -> list[int]:
        """The simulated hosts' processes."""
        return [a.pid for a in self.agents if a.pid is not None]

    def close(self) -> None:
        """The mesh is gone: its simulated hosts end, its slots are free again."""
        for a in self.agents:
            a._quit()
        for a in self.agents:
            a.stop()
        self.agents = []
        with _held_lock:
            _held.pop(id(self), None)


def ensure_descriptors(more: int) -> None:
    """Room for ``more`` open files in this process (the controller holds a TCP
    connection per rank): a soft limit that is short (1,024 is a common default)
    is raised to what is needed, within the hard one; a ValueError naming the
    limit when even the hard one is short."""
    try:
        import resource
    except ImportError:  # not on POSIX: nothing to check
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 64
    need = in_use + more + 64
    if soft == resource.RLIM_INFINITY or need <= soft:
        return
    if hard != resource.RLIM_INFINITY and need > hard:
        raise ValueError(
            f"a simulated mesh needs about {more} more open files here (a connection per "
            f"rank), {in_use} are open and the limit is {hard} (ulimit -n, hard): raise it "
            f"or ask for fewer ranks"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
