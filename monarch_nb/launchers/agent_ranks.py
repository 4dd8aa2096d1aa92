"""The controller's record of the ranks a host agent forked, shared by the local
agent (a pipe, ``host_agent.HostAgent``) and agents on other hosts (the
signed channel, ``remote_hosts.RemoteAgent``): a rank per fork request (slot),
its pid, exit status and output tail, from the agent's reports."""

from __future__ import annotations

import itertools
import os
import signal
import sys
import threading

from ..protocol import host_messages as hm
from ..protocol.receivers import AGENT_RANKS, handler_table
from .output_tail import OutputTail

SPAWN_TIMEOUT = 30.0  # s a rank's fork may take


class AgentRank:
    """A rank the agent forked, as WorkerSet watches a process."""

    fd = None  # its output pipe is the agent's; the tail arrives through the channel

    def __init__(self, agent: RankBook, slot: int, rank: int):
        self.agent, self.slot, self.rank = agent, slot, rank
        self.pid: int | None = None
        self.spawn_error: str | None = None
        self.returncode: int | None = None
        self.tail = OutputTail()
        self.spawned = threading.Event()
        self.ended = threading.Event()

    def poll(self) -> int | None:
        return self.returncode if self.ended.is_set() else None

    def wait(self, timeout: float) -> int | None:
        self.ended.wait(timeout)
        return self.poll()

    def read_output(self) -> bool:
        return False

    def tail_text(self) -> str:
        return self.tail.text()

    def kill(self, sig: int) -> None:
        if not self.ended.is_set():
            try:
                self.agent.send(hm.Kill(self.slot, int(sig)))
            except RuntimeError:
                pass  # the agent is gone, and its ranks with it (their end is reported)

    def close(self) -> None:
        """Nothing to close here: the agent holds the pipe."""

    def end(self, code: int | None, note: str = "") -> None:
        self.tail.end()
        if note:
            self.tail.lines.append(note)
        self.returncode = code
        self.spawned.set()
        self.ended.set()


class RankBook:
    """An agent's ranks that have not ended (slot -> AgentRank), kept from its
    reports. Subclasses ``send`` records to the agent."""

    failed_spawn_code: int | None = None  # a failed fork's returncode (None: not a crash)

    def _init_ranks(self) -> None:
        self._rank_handlers = handler_table(self, AGENT_RANKS, prefix="_rank_")
        self.ranks: dict[int, AgentRank] = {}
        self._slots = itertools.count(1)
        self._lock = threading.Lock()  # ranks (never held across IO)

    def send(self, msg) -> None:
        raise NotImplementedError

    def exit_note(self, r: AgentRank, code: int | None) -> str:
        """A line after a rank's output when it ends with ``code`` (where it ran, for a
        remote host; why, when its launcher knows: a job that reached its time limit)."""
        return ""

    def spawn_note(self, r: AgentRank, error: str) -> str:
        """The line a rank whose fork failed ends with (``failed_spawn_code`` set)."""
        return f"[the host agent could not start rank {r.rank}: {error}]"

    def on_rank(self, msg) -> bool:
        """Apply a rank's record (Output, Spawned, Exited, SpawnFailed); True when
        no rank is left running."""
        with self._lock:
            r = self.ranks.get(msg.slot)
            if r is not None and isinstance(msg, (hm.Exited, hm.SpawnFailed)):
                del self.ranks[msg.slot]
            idle = not self.ranks
        if r is not None:
            self._rank_handlers[type(msg)](r, msg)
        return idle

    def _rank_Output(self, r: AgentRank, msg: hm.Output) -> None:
        r.tail.feed(hm.output_bytes(msg))

    def _rank_Spawned(self, r: AgentRank, msg: hm.Spawned) -> None:
        r.pid = msg.pid
        r.spawned.set()

    def _rank_Exited(self, r: AgentRank, msg: hm.Exited) -> None:
        r.end(msg.code, self.exit_note(r, msg.code))

    def _rank_SpawnFailed(self, r: AgentRank, msg: hm.SpawnFailed) -> None:
        r.spawn_error = msg.error
        failed = self.failed_spawn_code is not None
        r.end(self.failed_spawn_code, self.spawn_note(r, msg.error) if failed else "")

    def spawn(
        self,
        rank: int,
        world: int,
        address: str,
        key: bytes,
        env: dict,
        local_rank: int | None = None,
        here: bool = True,
        host: int = -1,
    ) -> AgentRank:
        """Ask for one rank (answered by ``spawned`` on the AgentRank). ``here``: with
        this process's sys.path and cwd (a remote host's relay puts its own); ``host``:
        the mesh's index of this agent's host (a simulated host joins as it)."""
        with self._lock:
            slot = next(self._slots)
            r = self.ranks[slot] = AgentRank(self, slot, rank)
        cwd = os.getcwd() if here else ""
        paths = [p if p else cwd for p in sys.path] if here else []
        local = rank if local_rank is None else local_rank
        try:
            self.send(hm.Spawn(slot, rank, world, local, address, key.hex(), env, paths, cwd, host))
        except RuntimeError as e:
            with self._lock:
                self.ranks.pop(slot, None)
            r.spawn_error = str(e)
            failed = self.failed_spawn_code is not None
            r.end(self.failed_spawn_code, self.spawn_note(r, str(e)) if failed else "")
        return r

    def adopt(self, held: list) -> None:
        """Ranks the agent runs already (``[slot, rank, pid]`` each: a kept-alive mesh's,
        to a controller that attached)."""
        with self._lock:
            for slot, rank, pid in held:
                r = self.ranks[slot] = AgentRank(self, slot, rank)
                r.pid = pid
                r.spawned.set()
            self._slots = itertools.count(max((h[0] for h in held), default=0) + 1)

    def end_all(self, why: str) -> None:
        """The agent is gone: its ranks died with it (their parent-death signal)."""
        with self._lock:
            left, self.ranks = list(self.ranks.values()), {}
        for r in left:
            if r.pid is None and r.spawn_error is None:
                r.spawn_error = why
            r.end(-signal.SIGKILL, f"[{why}: its ranks died with it]")


def await_spawned(ranks: dict, world: int, agent_of, what: str) -> None:
    """Wait for each rank's start (SPAWN_TIMEOUT s each); if one failed, kill them all
    and raise naming the first (``agent_of(rank)``: the agent that could not)."""
    for r in ranks.values():
        r.spawned.wait(SPAWN_TIMEOUT)
    failed = [r for r in ranks.values() if r.spawn_error or not r.spawned.is_set()]
    if failed:
        for r in ranks.values():
            r.kill(signal.SIGKILL)
        first = failed[0]
        raise RuntimeError(
            f"{agent_of(first.rank)} could not start {what} {first.rank} of {world}: "
            f"{first.spawn_error or f'no answer within {SPAWN_TIMEOUT:.0f} s'}"
        )
