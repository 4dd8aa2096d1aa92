"""``python -m monarch_nb.host`` / ``monarch-nb-host``: the host agent.

It imports torch and the worker once, then forks this host's ranks when the
controller asks (``--stdio``: the controller that started it speaks on its
stdin/stdout, the local case; ``--connect ADDR`` or ``--connection-file F``:
join a controller on another host through a relay, see ``relay.py``).
``--simulate N`` runs N light ranks instead
(no torch, no fork: the control path only, see ``light.py``), so that one
machine can stand for many hosts.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from ..config import process_settings


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="monarch-nb-host",
        description="The host agent: imports torch once, then forks this host's ranks "
        "when its controller asks.",
    )
    p.add_argument(
        "--local-ranks",
        type=int,
        help="how many ranks this host runs at most (one per GPU on a GPU host)",
    )
    p.add_argument(
        "--simulate",
        type=int,
        metavar="N",
        help="run N light ranks in this process instead (no torch: the control path "
        "only, to measure the controller at scale)",
    )
    p.add_argument("--host-name", help="the name a simulated host reports (default: hostname/pid)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--stdio",
        action="store_true",
        help="serve the controller that started this process, on stdin/stdout",
    )
    where.add_argument(
        "--connect",
        metavar="ADDR",
        help="join a controller on another host at its agent channel, tcp://HOST:PORT "
        "(the secret from --key-file)",
    )
    where.add_argument(
        "--connection-file",
        metavar="F",
        help="join the controller named in F (the file connect_mesh wrote: address and secret)",
    )
    p.add_argument("--key-file", help="file holding the mesh secret (hex), with --connect")
    p.add_argument(
        "--node-rank",
        type=int,
        help="this host's slot: it runs ranks NODE_RANK*N .. NODE_RANK*N+N-1 (default "
        "SLURM_NODEID or GROUP_RANK, else the next free block)",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=None,
        help="with --connect: exit (ranks and all) when the controller has been silent this "
        "long (s; default: the setting heartbeat_timeout)",
    )
    p.add_argument("--parent-pid", type=int, help="exit when this process (the controller) is gone")
    # an agent the fork server forked (its parent): the controller it serves, watched by pid
    p.add_argument("--controller-pid", type=int, help=argparse.SUPPRESS)
    p.add_argument(
        "--keep-alive",
        type=float,
        metavar="S",
        help="with --stdio: keep the ranks S seconds after the controller goes (a kept-alive "
        "mesh's own agent; no --parent-pid)",
    )
    p.add_argument("--mesh-name", help="with --keep-alive: the mesh's name in the registry")
    # the relay's child: --local-ranks is this host's ranks, one per GPU (the local agent's
    # is a bound on the ranks of all its meshes, which share the GPUs)
    p.add_argument("--one-per-gpu", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.simulate is not None:
        if a.local_ranks is not None:
            p.error("--simulate N is the number of light ranks: leave out --local-ranks")
        if a.simulate < 1:
            p.error(f"--simulate must be at least 1 (got {a.simulate}): a host runs its ranks")
    elif a.local_ranks is None:
        p.error("--local-ranks N (or --simulate N) is required")
    elif a.local_ranks < 1:
        p.error(f"--local-ranks must be at least 1 (got {a.local_ranks}): a host runs its ranks")
    if a.keep_alive is not None and (a.keep_alive <= 0 or a.parent_pid or not a.stdio):
        p.error("--keep-alive S needs --stdio, a positive S and no --parent-pid")
    if a.connect or a.connection_file:
        sys.exit(_relay(p, a))
    from ..worker.__main__ import set_parent_death_signal

    if a.parent_pid:
        set_parent_death_signal(a.parent_pid)
    # the channel moves off fds 0/1: a stray print (an import's warning) cannot corrupt
    # it, and forked ranks get fresh fds 0/1/2
    ctl_in, ctl_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    if a.simulate is not None:  # no torch: nothing here is forked
        from .sim_agent import SimAgent

        host = a.host_name or f"{socket.gethostname()}/{os.getpid()}"
        SimAgent(a.simulate, ctl_in, ctl_out, a.parent_pid, host).serve()
        os._exit(0)
    preload()
    import torch

    from .agent import Agent

    gpus = torch.cuda.device_count() if a.one_per_gpu and torch.cuda.is_available() else 0
    if 0 < gpus < a.local_ranks:
        from ..protocol import host_messages as hm

        why = (
            f"--local-ranks {a.local_ranks} is more than this host's {gpus} GPU(s) "
            f"({socket.gethostname()}): one rank per GPU"
        )
        os.write(ctl_out, hm.encode(hm.Refused(why)))
        print(f"monarch-nb-host: {why}", file=sys.stderr, flush=True)
        os._exit(2)

    agent = Agent(a.local_ranks, ctl_in, ctl_out, a.parent_pid, a.keep_alive, a.mesh_name)
    if a.controller_pid and a.keep_alive is None:
        agent.watch_controller(a.controller_pid)
    elif a.controller_pid:  # kept alive: its channel's end orphans it, as a child's would
        agent.controller_pid = a.controller_pid
    agent.serve()
    sys.stdout.flush()
    os._exit(0)


def preload() -> None:
    """Import what every rank imports, once, here (before any thread exists: fork
    stays safe): the host agent's start, and the fork server's (``forkserver.py``)."""
    os.environ["MPLBACKEND"] = "module://monarch_nb.worker.mpl_backend"
    import torch  # noqa: F401

    from ..worker import cell_runner, worker  # noqa: F401
    from . import agent  # noqa: F401

    cell_runner.preload()  # IPython's shell: a rank's first cell skips its import (~50 ms)


def _relay(p: argparse.ArgumentParser, a) -> int:
    """``--connect`` / ``--connection-file``: the relay (its child is the ``--stdio`` agent)."""
    from .relay import Relay

    if a.simulate is not None:
        p.error("--simulate runs on this host only: leave out --connect")
    if a.connection_file:
        try:
            address, key_hex = read_connection(a.connection_file)
        except ValueError as e:
            p.error(str(e))
    else:
        address = a.connect
        if not a.key_file:
            p.error("--connect ADDR needs the mesh secret: --key-file K (or --connection-file F)")
        try:
            with open(a.key_file) as f:
                key_hex = f.read().strip()
        except OSError as e:
            p.error(f"cannot read the key file {a.key_file}: {e}")
    try:
        key = bytes.fromhex(key_hex)
    except ValueError:
        p.error("the mesh secret is not hex")
    node_rank = a.node_rank if a.node_rank is not None else env_node_rank()
    if node_rank is not None and node_rank < 0:
        p.error(f"--node-rank must be at least 0 (got {node_rank})")
    if a.heartbeat_timeout is None:
        a.heartbeat_timeout = process_settings()["heartbeat_timeout"]
    if a.heartbeat_timeout <= 0:
        p.error(f"--heartbeat-timeout must be positive (got {a.heartbeat_timeout})")
    return Relay(address, key, a.local_ranks, node_rank, a.heartbeat_timeout).serve()


def read_connection(path: str) -> tuple[str, str]:
    """(agent channel address, key hex) of a connection file; ValueError naming the problem."""
    import json

    try:
        with open(path) as f:
            info = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the connection file {path}: {e}") from None
    if "agents" not in info:
        raise ValueError(
            f"the connection file {path} names no agent channel (a mesh of per-rank "
            f"workers only: start monarch-nb-worker instead)"
        )
    return info["agents"], info["key"]


def env_node_rank() -> int | None:
    """This host's slot from its launcher: SLURM_NODEID (srun) or GROUP_RANK (torchrun)."""
    for name in ("SLURM_NODEID", "GROUP_RANK"):
        v = os.environ.get(name)
        if v not in (None, ""):
            return int(v)
    return None


if __name__ == "__main__":
    main()
