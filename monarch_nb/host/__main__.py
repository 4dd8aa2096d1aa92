"""``python -m monarch_nb.host`` / ``monarch-nb-host``: the host agent.

It imports torch and the worker once, then forks this host's ranks when the
controller asks (``--stdio``: the controller that started it speaks on its
stdin/stdout, the local case). ``--simulate N`` runs N light ranks instead
(no torch, no fork: the control path only, see ``light.py``), so that one
machine can stand for many hosts.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys


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
        help="join a controller over its signed socket (remote hosts: not built yet)",
    )
    p.add_argument("--parent-pid", type=int, help="exit when this process (the controller) is gone")
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
    if a.connect:
        p.error(
            "--connect: agents on other hosts (a signed ZeroMQ channel) are not built yet; "
            "the local agent is started by the controller with --stdio"
        )
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
    # what every rank imports, once, here (before any thread exists: fork stays safe)
    os.environ["MPLBACKEND"] = "module://monarch_nb.worker.mpl_backend"
    import torch  # noqa: F401

    from ..worker import worker  # noqa: F401
    from .agent import Agent

    Agent(a.local_ranks, ctl_in, ctl_out, a.parent_pid).serve()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
