"""The worker set: which workers a generation has, how they started, and their end.

Workers come from a launcher (``HostLauncher``: forked by this host's agent;
``LocalLauncher``: our own children; ``ExternalLauncher``: torchrun or srun,
through a connection file). The set admits them as they join, watches the
processes it started, pings those it did not, and stops them all.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

from .errors import WorkerCrashed

logger = logging.getLogger("monarch_nb.controller")


class Launcher:
    """Starts the workers of a mesh generation. Every member the controller calls is
    here, with what a launcher that has no such part does."""

    external: bool = False  # True: not our children (no process to watch; they get pings)
    keep_alive: float | None = None  # seconds its workers outlive this process (None: they die with it)
    shares_files: bool = True  # its ranks see this process's files (else the user's code travels)

    def launch(self, address: str, key: bytes, world: int) -> dict:
        """Start ``world`` workers that join ``address`` with ``key``: rank -> process
        (``pid``, ``poll()``, ``wait(timeout)``, ``kill(sig)``, ``close()``,
        ``tail_text()``, and ``fd``/``read_output()`` when the controller reads its
        output pipe itself), or {}."""
        raise NotImplementedError

    settings_env: dict = {}  # the mesh's settings, as its processes' variables
    connection_file: str | None = None  # where joining processes read the mesh's address

    def configure(self, settings_env: dict) -> None:
        """The mesh's settings (``config.process_env``): the ranks it starts get them."""
        self.settings_env = settings_env

    def attach(self, io) -> None:
        """The mesh's IO loop, before the first launch (host agents on other hosts
        reach its ROUTER)."""

    def agent_channel(self):
        """The channel of host agents on other hosts (``remote_hosts.AgentChannel``),
        or None."""
        return None

    def host_ranks(self, host: int, pid: int) -> range | None:
        """The ranks host agent ``host`` (process ``pid``) serves, or None if it is
        not one of this launcher's."""
        return None

    def held(self, address: str, key: bytes, world: int, timeout: float) -> dict:
        """rank -> process of the workers a kept-alive mesh kept running, once they came
        back to a controller that attached (agents on other hosts say what they hold)."""
        raise RuntimeError("this mesh's workers do not outlive their controller")

    def startup_failure(self) -> str | None:
        """Why the workers will never join (a job that ended before they did), or None."""
        return None

    def close(self) -> None:
        """The mesh is gone for good: clean up (a connection file, a job)."""

    def let_go(self) -> None:
        """The controller lets go of the mesh (``Controller.detach``), its workers left
        running: drop the link to them (a kept-alive mesh's agent waits for another)."""


class WorkerSet:
    """The workers of the current generation."""

    def __init__(self, name: str, world: int, launcher: Launcher, state):
        self.name = name
        self.world = world
        self.launcher = launcher
        self.state = state
        self.identities: dict[int, bytes] = {}  # rank -> socket identity (shared with IOLoop)
        self.reset()

    def reset(self) -> None:
        """A new generation: nobody has joined."""
        self.identities.clear()
        self.cuda: dict[int, bool] = {}
        self.procs: dict = {}
        self.rejoined: dict | None = None  # rank -> WorkerRejoined, while attaching (rejoin.py)
        self.ready = threading.Event()
        self.startup_error: BaseException | None = None
        self._next_ping = 0.0

    # ------------------------------------------------------------ joining

    def admit(self, msg, identity: bytes) -> str | None:
        """A WorkerReady: None if admitted, else why it is refused."""
        if msg.world != self.world:
            return f"world size {msg.world} differs from the mesh's {self.world}"
        if not 0 <= msg.rank < self.world:
            return f"rank {msg.rank} is outside the mesh (world {self.world})"
        if msg.rank in self.identities:
            return f"rank {msg.rank} has joined already (pid {self.state.workers[msg.rank].pid})"
        if self.ready.is_set():
            return "the mesh is complete: late workers are not taken"
        self.identities[msg.rank] = identity
        self.cuda[msg.rank] = msg.cuda
        self.state.worker_ready(msg.rank, msg.pid, msg.host)
        if len(self.identities) == self.world:
            self.ready.set()
        return None

    def all_cuda(self) -> bool:
        return bool(self.cuda) and all(self.cuda.values())

    def missing(self) -> list[int]:
        return sorted(set(range(self.world)) - set(self.identities))

    # ------------------------------------------------------------ watching

    def pings_due(self) -> bool:
        """Workers that are not our children hear from us every second (they exit
        when the pings stop)."""
        if not (self.launcher.external and self.identities):
            return False
        now = time.monotonic()
        if now < self._next_ping:
            return False
        self._next_ping = now + 1.0
        return True

    def exited(self, proc, wait: float = 0.0, closing: bool = False) -> WorkerCrashed | None:
        """Check ``proc``; the crash if it ended unasked (else None)."""
        code = proc.poll()
        if code is None and wait:
            code = proc.wait(wait)
        if code is None:
            return None
        if self.procs.get(proc.rank) is not proc:
            return None  # a worker of an earlier generation (restart) whose pipe closed late
        w = self.state.workers.get(proc.rank)
        if w is None or (not w.alive and w.exit is not None):
            return None
        while proc.fd is not None and proc.read_output():
            pass
        self.state.worker_exited(proc.rank, code)
        if closing:
            return None
        err = WorkerCrashed(proc.rank, code, proc.tail_text(), self.name)
        if not self.ready.is_set():
            self.startup_error = err
            self.ready.set()
        return err

    # ------------------------------------------------------------ stopping

    def stop(self, timeout: float) -> None:
        """Wait up to ``timeout`` for our children to exit (they were sent Exit),
        then SIGTERM, then SIGKILL."""
        deadline = time.monotonic() + timeout
        procs = list(self.procs.values())
        for p in procs:
            p.wait(max(0.0, deadline - time.monotonic()))
        for sig, grace in ((signal.SIGTERM, 1.0), (signal.SIGKILL, 2.0)):
            left = [p for p in procs if p.poll() is None]
            if not left:
                break
            for p in left:
                p.kill(sig)
            end = time.monotonic() + grace
            for p in left:
                p.wait(max(0.0, end - time.monotonic()))
        for p in procs:
            p.close()
            self.state.worker_exited(p.rank, p.poll())

    def close(self) -> None:
        """The mesh is gone for good: the launcher cleans up (a connection file)."""
        try:
            self.launcher.close()
        except Exception:
            logger.exception("mesh %r: closing the launcher failed", self.name)

    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self.procs.items()}
