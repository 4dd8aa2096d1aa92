"""Launchers start worker processes. LocalLauncher: one fresh process per rank on this
host (launchers/host_agent.py's HostLauncher forks them from a host agent instead);
ExternalLauncher: workers, or host agents, that another launcher starts."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

from ..controller.workers import Launcher
from .connection_file import default_connection_file, write_connection_file
from .output_tail import OutputTail


def _visible_gpus() -> list[str]:
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    try:
        n = torch.cuda.device_count()
    except Exception:
        return []
    if n == 0:
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [d.strip() for d in visible.split(",") if d.strip()][:n]
    return [str(i) for i in range(n)]


class LocalProcess:
    """One worker spawned here (``MONARCH_NB_SPAWN=popen``): its Popen and output tail.
    WorkerSet uses ``pid``, ``poll()``, ``wait(t)``, ``kill(sig)``, ``close()``,
    ``tail_text()`` and, while ``fd`` is not None, ``read_output()``."""

    def __init__(self, rank: int, popen: subprocess.Popen):
        self.rank = rank
        self.popen = popen
        self.fd = popen.stdout.fileno() if popen.stdout is not None else None
        self.tail = OutputTail()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout: float) -> int | None:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def read_output(self) -> bool:
        """Read what is available from the worker's stdout/stderr pipe; False at EOF."""
        if self.fd is None:
            return False
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        if not data:
            self.tail.end()
            self.fd = None
            return False
        self.tail.feed(data)
        return True

    def tail_text(self) -> str:
        return self.tail.text()

    def kill(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            try:
                self.popen.send_signal(sig)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        if self.popen.stdout is not None:
            try:
                self.popen.stdout.close()
            except OSError:
                pass


def local_env(world: int, settings_env: dict) -> dict:
    """The environment of a local mesh's workers, less their rank: the controller's,
    with the mesh's settings (``settings_env``), its sys.path as PYTHONPATH and the
    settings below."""
    base = {**os.environ, **settings_env}
    base.pop("MONARCH_NB_KEY", None)
    # the workers import what the controller imports, from the same places
    paths = [p if p else os.getcwd() for p in sys.path]
    base["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    base["PYTHONUNBUFFERED"] = "1"
    # local workers only talk to each other: gloo listens on the loopback interface
    # (by default it binds to whatever the host name resolves to, often the LAN)
    base.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
    if "OMP_NUM_THREADS" not in os.environ:
        base["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world))
    # glibc maps allocations over 32 MiB afresh each time (and unmaps them on free):
    # every large result tensor would pay for ~16k page faults. Keep them on the
    # heap and reuse them, as a caching allocator would.
    base.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 30))
    base.setdefault("MALLOC_TRIM_THRESHOLD_", str(1 << 30))
    return base


def rank_env(base: dict, rank: int, world: int, gpus: list[str]) -> dict:
    """``base`` with the rank's variables (and its GPU, when there are GPUs)."""
    env = dict(base)
    env.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)
    )
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = gpus[rank % len(gpus)]
    return env


class LocalLauncher(Launcher):
    """Spawns ``world`` fresh ``python -m monarch_nb.worker`` processes on this host,
    one GPU each when GPUs are present (the path before host agents, kept for
    ``MONARCH_NB_SPAWN=popen`` and the benchmark's comparison)."""

    external = False  # the workers are our children: we watch their processes

    def launch(self, address: str, key: bytes, world: int) -> dict[int, LocalProcess]:
        gpus = _visible_gpus()
        base = local_env(world, self.settings_env)
        procs = {}
        for rank in range(world):
            env = rank_env(base, rank, world, gpus)
            cmd = [
                sys.executable,
                "-m",
                "monarch_nb.worker",
                "--connect",
                address,
                "--key-stdin",
                "--parent-pid",
                str(os.getpid()),
            ]
            popen = subprocess.Popen(
                cmd,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a terminal's Ctrl-C goes to the controller only
                close_fds=True,
            )
            popen.stdin.write(key.hex().encode() + b"\n")
            popen.stdin.close()
            os.set_blocking(popen.stdout.fileno(), False)
            procs[rank] = LocalProcess(rank, popen)
        return procs

    def close(self) -> None:
        """Nothing to clean up: the controller stops its children itself."""


class ExternalLauncher(Launcher):
    """Starts nothing: another launcher (torchrun, srun, mpirun, a pod per rank)
    runs ``monarch-nb-worker --connection-file F`` per rank, or
    ``monarch-nb-host --connection-file F --local-ranks N`` per host (a host
    agent, which forks its N ranks when the controller asks: ``remote_hosts.py``).
    Writes the connection file (address, agent channel and secret, mode 0600),
    prints the command lines, and removes the file at shutdown."""

    external = True
    shares_files = False  # ranks anywhere: autoreload ships the user's changed sources

    def __init__(
        self,
        name: str,
        dims: dict,
        connection_file: str | None = None,
        out=print,
        interface: str = "127.0.0.1",
        agent_timeout: float = 10.0,
        keep_alive: float | None = None,
        rejoin: bytes | None = None,
    ):
        """``keep_alive``: the host agents keep their ranks that long once this process
        is gone (per-rank workers do not: they end with it); ``rejoin``: the key of such
        a mesh this process attaches to, whose agents come back (``held``)."""
        self.keep_alive, self.rejoin = keep_alive, rejoin
        self.name = name
        self.dims = dict(dims)
        self.connection_file = connection_file or default_connection_file(name)
        self._out = out
        self._written: tuple | None = None  # (device, inode) of the file written here
        self.interface, self.agent_timeout = interface, agent_timeout
        self.agents = None  # the AgentChannel, from the first launch on
        self._io = None

    def agent_channel(self):
        return self.agents

    def attach(self, io) -> None:
        """The mesh's IO loop: host agents reach its ROUTER, the only port of the mesh."""
        self._io = io
        io.on_disconnect = lambda fd: self.agents.disconnected(fd) if self.agents else None
        if self.rejoin is not None:  # before the ROUTER reads: a relay's Hello may wait there
            world = math.prod(self.dims.values())
            self._channel(f"tcp://{self.interface}:{io.port}", self.rejoin, world)

    def _channel(self, address: str, key: bytes, world: int):
        if self.agents is None:
            from .remote_hosts import AgentChannel

            if self._io is None:
                raise RuntimeError("ExternalLauncher.launch before attach(io): no ROUTER")
            host = address.rsplit(":", 1)[0].split("//", 1)[-1]
            self.agents = AgentChannel(
                self.name, self._io, host, key, world, self.agent_timeout, self._out,
                self.keep_alive, self.rejoin is not None,
            )  # fmt: skip
        return self.agents

    def held(self, address: str, key: bytes, world: int, timeout: float) -> dict:
        """rank -> AgentRank of the ranks a kept-alive mesh's host agents kept running,
        once they came back to this process (``remote_agent.held_ranks``)."""
        from .remote_agent import held_ranks

        channel = self._channel(address, key, world)
        procs = held_ranks(channel.hosts, self.name, world, timeout)
        if os.path.exists(self.connection_file):  # the first controller's: ours to remove now
            st = os.lstat(self.connection_file)
            self._written = (st.st_dev, st.st_ino)
        return procs

    def let_go(self) -> None:
        """Leave the host agents running: they wait for another controller (the
        registry entry says since when)."""
        if self.agents is not None:
            self.agents.close(quit=False)
            self.agents = None
        if self.keep_alive is not None:
            from ..protocol import keepalive

            keepalive.update_entry(self.name, orphaned_at=time.time())

    def launch(self, address: str, key: bytes, world: int) -> dict:
        procs = self._channel(address, key, world).launch(address, key, world)
        f = self.connection_file
        if not self._still_ours():  # a restart keeps the file it wrote
            self._written = write_connection_file(
                f, address, key, world, self.name, self.dims, self.agents.address
            )
        if len(procs) < world:
            self._out(self.lines(address, world))
        return procs

    def host_ranks(self, host: int, pid: int) -> range | None:
        """The ranks host agent ``host`` (its relay's ``pid``) serves, or None."""
        return self.agents.host_ranks(host, pid) if self.agents is not None else None

    def lines(self, address: str, world: int) -> str:
        """How to start the workers (the text printed at launch)."""
        f, agents = self.connection_file, self.agents.address
        return (
            f"mesh {self.name!r} waits for {world} workers at {address}\n"
            f"connection file (addresses and secret): {f}\n"
            f"start one host agent per host (it forks its ranks; host agents at {agents}):\n"
            f"  srun --ntasks-per-node 1 monarch-nb-host --connection-file {f} --local-ranks 8\n"
            f"  (or: monarch-nb-host --connect {agents} --key-file K --local-ranks 8)\n"
            f"  torchrun --nnodes NODES --nproc-per-node 1 -m monarch_nb.host "
            f"--connection-file {f} --local-ranks 8\n"
            f"  (Kubernetes: mnb.k8s_manifest(...) writes the Job, then kubectl create secret "
            f"generic NAME-connection --from-file=connection.json={f})\n"
            f"or one worker per rank, with torchrun on each host:\n"
            f"  torchrun --nnodes NODES --nproc-per-node PER_NODE --node-rank I "
            f"--master-addr HOST0 -m monarch_nb.worker --connection-file {f}\n"
            f"  (one host: torchrun --standalone --nproc-per-node {world} -m monarch_nb.worker "
            f"--connection-file {f})\n"
            f"or with srun inside an allocation:\n"
            f"  srun --ntasks {world} python -m monarch_nb.worker --connection-file {f}"
        )

    def close(self) -> None:
        """End the host agents (Quit) and remove the connection file, if the one at
        its path is still ours."""
        if self.agents is not None:
            self.agents.close()
            self.agents = None
        if self.keep_alive is not None:  # the mesh ended: no longer live
            from ..protocol import keepalive

            keepalive.remove_entry(self.name)
        if self._still_ours():
            try:
                os.unlink(self.connection_file)
            except OSError:
                pass
        self._written = None

    def _still_ours(self) -> bool:
        if self._written is None:
            return False
        try:
            st = os.lstat(self.connection_file)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._written
