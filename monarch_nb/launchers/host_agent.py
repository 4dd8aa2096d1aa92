"""HostLauncher: a local mesh's ranks forked by this host's agent (``monarch-nb-host``).

One agent per controller process, started as its first local mesh begins (forked by
this user's fork server, ``agent_forkserver.py``, else a child whose parent-death
signal follows the reader thread here, which lives as long as this process) and kept
warm for every later mesh and restart. Its channel is its stdin/stdout (a private
pipe): the thread reads its reports and keeps each rank's exit status and output tail
for WorkerSet. ``MONARCH_NB_SPAWN=popen`` picks the LocalLauncher (a process per rank).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

from .. import config
from ..controller.errors import describe_exit
from ..controller.workers import Launcher
from ..protocol import host_messages as hm
from ..protocol.receivers import AGENT_LINK, handler_table
from .agent_forkserver import import_time_env, spawn_agent
from .agent_ranks import AgentRank, RankBook, await_spawned
from .local import LocalLauncher, _visible_gpus, local_env, rank_env

logger = logging.getLogger("monarch_nb.controller")

AGENT_START_TIMEOUT = 120.0  # importing torch on a busy machine
LOCAL_RANKS = 1024  # the local agent's slots: ranks of every mesh of this process
LET_GO_WAIT = 10.0  # for a let-go agent to hang up (it does within ms)


__all__ = ["AgentRank", "HostAgent", "HostLauncher", "await_spawned", "local_agent"]


class HostAgent(RankBook):
    """A local agent process (``local_ranks`` slots) and the thread that reads its reports."""

    def __init__(
        self,
        local_ranks: int = LOCAL_RANKS,
        wait: bool = True,
        simulate: int = 0,
        host_name: str | None = None,
        prefix: tuple = (),
        keep_alive: float | None = None,
        mesh_name: str | None = None,
    ):
        """Start the agent; with ``wait``, return once it takes Spawns (else call
        ``wait_ready``, as ``HostLauncher`` does). ``simulate=N``: a simulated host
        of N light ranks named ``host_name``; ``prefix``: before its command (netns).
        ``keep_alive=S``: the agent of one kept-alive mesh, ``mesh_name``, that
        outlives this process by S seconds (no parent-death signal)."""
        self.local_ranks, self.prefix = simulate or local_ranks, tuple(prefix)
        self.keep_alive, self.mesh_name = keep_alive, mesh_name
        self.simulate, self.host_name = simulate, host_name
        self.label = f"simulated host {host_name}" if simulate else "the host agent"
        self._init_ranks()  # slot -> rank not ended yet
        self._handlers = handler_table(self, AGENT_LINK)
        # whole lines on the agent's stdin; apart from _lock: a write blocked on a full
        # pipe must not stop the reader thread, which the agent may be waiting on
        self._write_lock = threading.Lock()
        self._ready = threading.Event()
        self._started = threading.Event()  # the process exists (or could not be made)
        self.info: hm.AgentReady | None = None
        self.error: str | None = None
        self.popen: subprocess.Popen | None = None
        self.on_detach = None  # fn(pid) when another controller takes the mesh (steal)
        self.detached = False  # this process let go of the agent (its ranks run on)
        self.held = threading.Event()  # an attached agent's Held arrived
        self.owner = os.getpid()  # a forked copy of this process starts its own agent
        env = local_env(1, {})
        self.env_key = import_time_env(env)
        self.retired = False
        env["OMP_NUM_THREADS"] = "1"  # the agent computes nothing; each rank sets its own
        self._thread = threading.Thread(
            target=self._run, args=(env,), name="monarch-host-agent", daemon=True
        )
        self._thread.start()
        self._started.wait(AGENT_START_TIMEOUT)
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait until the agent has imported what ranks need; raises if it cannot start."""
        if not self._ready.wait(AGENT_START_TIMEOUT):
            self.stop()
            raise TimeoutError(f"the host agent did not start within {AGENT_START_TIMEOUT:.0f} s")
        if self.error is not None:
            raise RuntimeError(self.error)

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    @property
    def alive(self) -> bool:
        return self.error is None and self.popen is not None and self.popen.poll() is None

    # ------------------------------------------------------------ the reader thread

    def _run(self, env: dict) -> None:
        fd = self._open(env)
        if fd is None:
            return
        reader = hm.LineReader()
        while True:
            try:
                data = os.read(fd, 1 << 16)
            except OSError:
                data = b""
            if not data:
                break
            for msg in reader.feed(data):
                try:
                    self._on(msg)
                except Exception:  # this thread must read on: the agent blocks otherwise
                    logger.exception("host agent %s: handling %r failed", self.pid, msg)
        if self.detached:
            self._close_link()
        else:
            self._gone(self._exit_code())

    def _close_link(self) -> None:
        """This process let go and the agent hung up: our end of its pipe, closed."""
        try:
            self.popen.stdout.close()
        except OSError:
            pass

    def _exit_code(self) -> int:
        return self.popen.wait()

    def _open(self, env: dict) -> int | None:
        """Start the agent; the fd its reports come on (None: it could not start)."""
        if self.simulate:  # a script that loads neither the API nor torch (sim_boot.py)
            cmd = [sys.executable, sim_boot_path(), "--stdio", "--simulate", str(self.simulate)]
            cmd += ["--host-name", str(self.host_name)]
        else:
            cmd = [sys.executable, "-m", "monarch_nb.host", "--stdio"]
            cmd += ["--local-ranks", str(self.local_ranks)]
        if self.keep_alive is None:
            cmd = [*self.prefix, *cmd, "--parent-pid", str(os.getpid())]
        else:
            cmd = [*self.prefix, *cmd, "--keep-alive", repr(self.keep_alive)]
            cmd += ["--mesh-name", str(self.mesh_name)]
        forked = self._forked(env)
        if forked is not None:
            self.popen = forked
            self._started.set()
            return forked.stdout.fileno()
        try:
            self.popen = subprocess.Popen(
                cmd,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                bufsize=0,  # whole lines leave at once; a fork of this process flushes nothing
                start_new_session=True,  # a terminal's Ctrl-C goes to the controller only
                close_fds=True,
            )
        except OSError as e:
            self.error = f"cannot start {self.label} ({' '.join(cmd[:3])}): {e}"
            self._ready.set()
            self._started.set()
            return None
        self._started.set()
        return self.popen.stdout.fileno()

    def _forked(self, env: dict):
        """The agent forked by the fork server (``agent_forkserver.py``), a kept-alive
        mesh's own too, where the setting allows it; else None (it starts as a child)."""
        idle = config.setting("agent_forkserver_idle")
        if self.simulate or self.prefix or not idle > 0:
            return None
        argv = ["--stdio", "--local-ranks", str(self.local_ranks)]
        if self.keep_alive is not None:  # (it outlives this process: it is not our child)
            argv += ["--keep-alive", repr(self.keep_alive), "--mesh-name", str(self.mesh_name)]
        try:
            return spawn_agent([*argv, "--controller-pid", str(os.getpid())], env, idle)
        except Exception as e:
            logger.info("the host agent starts without the fork server: %s", e)
            return None

    def _on(self, msg) -> None:
        handler = self._handlers.get(type(msg), self.Refused)  # else: a line of no record
        handler(msg)

    def AgentReady(self, msg: hm.AgentReady) -> None:
        self.info = msg
        self._ready.set()

    def Refused(self, msg) -> None:
        print(f"monarch_nb: host agent {self.pid}: {msg}", file=sys.stderr)

    def Held(self, msg: hm.Held) -> None:
        self.adopt(msg.ranks)
        self.held.set()

    def Detach(self, msg: hm.Detach) -> None:
        """Another controller took the mesh: this process lets go (on a thread of its
        own: letting go closes the link this thread reads)."""
        self.detached = True
        if self.on_detach is not None:
            threading.Thread(target=self.on_detach, args=(msg.pid,), daemon=True).start()

    def let_go(self, timeout: float = LET_GO_WAIT) -> None:
        """Leave the agent and its ranks running: close our end of its stdin (it hangs
        up in turn, and the reader closes the other pipe: not under the reader's feet).
        Returns once it hung up (within ``timeout`` s): it counts itself orphaned then, so
        an attach that follows, this process's own included, is let in."""
        self.detached = True
        if self.popen is not None:
            try:
                self.popen.stdin.close()
            except OSError:
                pass
            self._await_hangup(timeout)

    def _await_hangup(self, timeout: float) -> None:
        """Wait (within ``timeout`` s) until the reader saw the agent hang up; never on
        the reader itself (a steal comes on it)."""
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def wait_ended(self, timeout: float) -> None:
        """Wait for the agent process to end (then kill it)."""
        if self.popen is not None:
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()

    def _rank_record(self, msg) -> None:
        if self.on_rank(msg) and self.retired:
            # not from this thread: a write may wait for the agent, which may wait for us
            threading.Thread(target=self._quit, name="monarch-host-retire", daemon=True).start()

    Spawned = SpawnFailed = Output = Exited = _rank_record

    def _gone(self, code: int) -> None:
        """The agent exited: its ranks died with it (their parent-death signal)."""
        how = describe_exit(code)
        how = f"was {how}" if code < 0 else f"exited ({how})"
        why = f"{self.label} (pid {self.pid}) {how}"
        if self.info is None:
            self.error = f"{why} before it was ready (its stderr went to this process's stderr)"
        else:
            self.error = why
        self._ready.set()
        self.end_all(why)

    # ------------------------------------------------------------ commands

    def send(self, msg) -> None:
        line = hm.encode(msg)
        with self._write_lock:
            if not self.alive:
                raise RuntimeError(self.error or "the host agent is gone")
            try:
                view = memoryview(line)
                while view:
                    view = view[self.popen.stdin.write(view) :]
            except (BrokenPipeError, ValueError, OSError) as e:
                raise RuntimeError(f"the host agent (pid {self.pid}) is gone: {e}") from None

    def retire(self) -> None:
        """No more Spawns: end once the ranks it runs have ended."""
        with self._lock:
            self.retired = True
            idle = not self.ranks
        if idle:
            self._quit()

    def _quit(self) -> None:
        try:
            self.send(hm.Quit())
        except RuntimeError:
            pass

    def stop(self) -> None:
        """Kill its ranks and end it (tests; the process's exit does the same)."""
        if self.popen is None:
            return
        self._quit()
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(10)
        self._thread.join(10)


_agent: HostAgent | None = None
_agent_lock = threading.Lock()


def _forget_in_child() -> None:
    """A fork of this process (multiprocessing, a forked controller) does not share
    the agent: it drops its copies of the channel, so the agent still sees its
    controller's end when the controller goes."""
    global _agent, _agent_lock
    _agent_lock = threading.Lock()
    agent, _agent = _agent, None
    if agent is not None and agent.popen is not None:
        for f in (agent.popen.stdin, agent.popen.stdout):  # unbuffered: nothing to flush
            try:
                f.close()
            except OSError:
                pass


os.register_at_fork(after_in_child=_forget_in_child)


def local_agent(wait: bool = True) -> HostAgent:
    """This process's agent: the warm one, or a new one when there is none, it died,
    or a setting read at import time changed in the environment since it started.
    With ``wait``, once it takes Spawns."""
    global _agent
    with _agent_lock:
        agent = _agent
        ours = agent is not None and agent.owner == os.getpid() and agent.alive
        if not (ours and agent.env_key == import_time_env(local_env(1, {}))):
            if ours:
                agent.retire()
            agent = _agent = HostAgent(wait=False)
    if wait:
        try:
            agent.wait_ready()
        except BaseException:
            with _agent_lock:
                if _agent is agent:
                    _agent = None
            raise
    return agent


def warm_local_agent() -> None:
    """Start the agent now, in the background, when local meshes use it: its torch
    import overlaps the caller's own start-up (a failure shows at the mesh's launch)."""
    if config.setting("spawn") == "agent":
        try:
            local_agent(wait=False)
        except Exception:
            pass


def sim_boot_path() -> str:
    """monarch_nb/host/sim_boot.py, found without importing monarch_nb.host."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(root, "host", "sim_boot.py")


class HostLauncher(Launcher):
    """Forks a mesh's ranks from ``agent`` (default: this process's warm one), one
    GPU each when GPUs are present."""

    external = False  # the agent watches them and reports their end at once

    def __init__(self, agent: HostAgent | None = None, keep_alive: float | None = None):
        self.agent = agent
        self.keep_alive = keep_alive  # the agent is the mesh's own and outlives this process

    def launch(self, address: str, key: bytes, world: int) -> dict[int, AgentRank]:
        agent = self.agent or local_agent()
        agent.wait_ready()  # at once when warm; says why when it died
        gpus = _visible_gpus()
        base = local_env(world, self.settings_env)
        ranks = {
            r: agent.spawn(r, world, address, key, rank_env(base, r, world, gpus))
            for r in range(world)
        }
        await_spawned(ranks, world, lambda r: f"the host agent (pid {agent.pid})", "rank")
        return ranks

    def close(self) -> None:
        """Nothing to clean up: the agent stays warm for the next mesh (a kept-alive
        mesh's own agent is told to end: the mesh was shut down)."""
        if self.keep_alive is not None and self.agent is not None:
            self.agent.retire()  # it ends (and drops the mesh's registry entry) with its ranks
            self.agent.wait_ended(10)

    def let_go(self) -> None:
        if self.keep_alive is not None and self.agent is not None:
            self.agent.let_go()


def default_launcher(spawn: str = "agent"):
    """The launcher of a local mesh: HostLauncher, or with the setting ``spawn="popen"``
    the LocalLauncher (a fresh ``python -m monarch_nb.worker`` per rank)."""
    if spawn == "popen":
        return LocalLauncher()
    if spawn != "agent":
        raise ValueError(f"spawn={spawn!r}: expected 'agent' (the default) or 'popen'")
    return HostLauncher()
