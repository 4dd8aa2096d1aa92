"""Who started a local host agent: its controller (Popen), or the fork server that
forks agents for every controller of this user (``monarch_nb.host.forkserver``)."""

from __future__ import annotations

import psutil


def forkserver_pid(agent_pid: int) -> int | None:
    """The pid of the fork server that forked ``agent_pid``, or None (not forked by one)."""
    parent = psutil.Process(agent_pid).parent()
    if parent is not None and "monarch_nb.host.forkserver" in " ".join(parent.cmdline()):
        return parent.pid
    return None


def started_for(agent_pid: int, controller_pid: int) -> bool:
    """The agent is the controller's child, or a fork server's."""
    return psutil.Process(agent_pid).ppid() == controller_pid or forkserver_pid(agent_pid) is not None
