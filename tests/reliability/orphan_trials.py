"""Controller-kill trials (run as a script by test_faults.py).

``python orphan_trials.py FIRST COUNT``: trials FIRST .. FIRST+COUNT-1. Each
trial forks a controller process (torch and monarch_nb are imported once, here,
so a trial costs only its workers' start), lets it reach a phase, kills it with
SIGKILL and waits up to BOUND seconds for every worker it had started to be
gone: its host agent (forked by this user's fork server, the default, found by
the pipe it reads from the controller) and the agent's ranks. One JSON line per
trial on stdout.

Phases, in turn: ``starting`` (workers spawned, still starting up: killed 0 to
0.8 s after the first one appears), ``idle`` (a ready dp=1 mesh), ``busy`` (a
command in a Python loop) and ``collective`` (dp=2, rank 0 blocked inside an
all_reduce that rank 1 never joins: stuck in C).
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time

import psutil
import torch  # noqa: F401 - imported once; every forked controller inherits it
import torch.distributed  # noqa: F401

import monarch_nb as mnb

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from agent_helpers import agents_of, forkserver_pid  # noqa: E402

BOUND = 5.0
PHASES = ("starting", "idle", "busy", "collective")


def lonely(group):
    """Rank 0 enters an all_reduce that rank 1 never joins."""
    import torch.distributed as dist

    if mnb.current_rank() == 0:
        dist.all_reduce(torch.ones(1), group=group)


def controller(phase: str, ready_fd: int) -> None:
    """The forked controller process."""
    mesh = mnb.local_mesh(dp=2 if phase == "collective" else 1, name="trial")
    if phase == "busy":
        mesh.exec("while True:\n    pass")
    elif phase == "collective":
        mnb.remote(lonely)(mesh.process_group("dp"), mesh=mesh)
    deadline = time.monotonic() + 30
    while phase in ("busy", "collective") and time.monotonic() < deadline:
        st = mesh.status()["ranks"][0]["streams"]["default"]
        if st["running"] is not None and st["running"]["elapsed"] > 0.3:
            break
        time.sleep(0.02)
    os.write(ready_fd, b"ready\n")
    time.sleep(600)


def gone_within(pids: list[int], bound: float) -> tuple[list[int], float]:
    t0 = time.monotonic()
    left = list(pids)
    while left and time.monotonic() - t0 < bound:
        left = [p for p in left if _alive(p)]
        if left:
            time.sleep(0.01)
    return left, time.monotonic() - t0


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def trial(i: int) -> dict:
    phase = PHASES[i % len(PHASES)]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the controller
        os.close(r)
        try:
            controller(phase, w)
        finally:
            os._exit(1)
    os.close(w)
    seen: set[int] = set()
    agents: set[int] = set()  # the controller's host agent (a fork server's): its ranks' parent
    forked: set[int] = set()  # those of them a fork server forked

    def look() -> None:
        try:
            for a in agents_of(pid) - agents:
                agents.add(a)
                if forkserver_pid(a) is not None:
                    forked.add(a)
            for a in agents:  # (not the controller's other children: a fork server it starts)
                seen.add(a)
                seen.update(c.pid for c in psutil.Process(a).children(recursive=True))
        except (psutil.Error, OSError):
            pass

    if phase == "starting":
        deadline = time.monotonic() + 60
        while not seen - agents and time.monotonic() < deadline:
            look()
            time.sleep(0.005)
        time.sleep(0.2 * ((i // len(PHASES)) % 5))
    else:
        ready, _, _ = select.select([r], [], [], 120)
        assert ready and os.read(r, 64) == b"ready\n", f"trial {i}: the controller never got ready"
    look()
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(r)
    left, elapsed = gone_within(sorted(seen), BOUND)
    workers = sorted(seen - agents)
    return {
        "trial": i,
        "phase": phase,
        "workers": workers,
        "agents": sorted(agents),
        "forked": sorted(forked),
        "left": left,
        "after": elapsed,
    }


def main(run_trial=None) -> None:
    """``SCRIPT FIRST COUNT``: trials FIRST .. FIRST+COUNT-1 of ``run_trial`` (default:
    this script's), a JSON line each."""
    first, count = int(sys.argv[1]), int(sys.argv[2])
    for i in range(first, first + count):
        print(json.dumps((run_trial or trial)(i)), flush=True)


if __name__ == "__main__":
    main()
