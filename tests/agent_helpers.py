"""Who started a local host agent: its controller (Popen), or the fork server that
forks agents for every controller of this user (``monarch_nb.host.forkserver``)."""

from __future__ import annotations

import os

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


def agents_of(controller_pid: int) -> set[int]:
    """The host agents serving the process ``controller_pid``: its children, or those a
    fork server forked for it. Either way an agent's channel is a pair of pipes whose
    other ends the controller holds (its ranks may share them: the agent is the topmost).
    The controller's stdio is left out: its agents share that with other processes'."""
    pipes = _pipes(controller_pid, skip=("0", "1", "2"))
    fed: dict[int, int] = {}  # pid -> ppid of the processes holding one of those pipes
    for p in psutil.process_iter(["ppid", "cmdline"]):
        if p.pid == controller_pid or "monarch_nb.host" not in " ".join(p.info["cmdline"] or ()):
            continue
        if _pipes(p.pid) & pipes:
            fed[p.pid] = p.info["ppid"]
    return {pid for pid, ppid in fed.items() if ppid not in fed}


def _pipes(pid: int, skip: tuple = ()) -> set[str]:
    found: set[str] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        if fd in skip:
            continue
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("pipe:"):
            found.add(link)
    return found
