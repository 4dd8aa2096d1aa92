"""Keep-alive expiry trials (run as a script by test_expiry.py).

``python expiry_trials.py FIRST COUNT``: trials FIRST .. FIRST+COUNT-1. Each
trial forks a controller process that starts a kept-alive mesh (``keep_alive``
1 s; 4 s where a second process must attach within it), lets it reach a phase,
kills it with SIGKILL, and waits up to the keep-alive and BOUND seconds for the
mesh's agent and ranks to be gone and its registry entry removed. One JSON line per trial on stdout. (``MONARCH_NB_MESH_DIR`` names the
registry: the test's own.)

Phases, in turn: ``idle`` (a ready dp=1 mesh), ``busy`` (a command in a Python
loop), ``printing`` (a rank's thread printing without end), ``attached`` (a
second forked process attaches, runs a command, and is killed in turn: the
keep-alive starts again) and ``collective`` (dp=2, rank 0 blocked inside an
all_reduce that rank 1 never joins: stuck in C).
"""

from __future__ import annotations

import os
import select
import signal
import time
import traceback

import psutil
import torch  # noqa: F401 - imported once; every forked controller inherits it
import torch.distributed  # noqa: F401
from orphan_trials import forkserver_pid, gone_within, main

import monarch_nb as mnb
from monarch_nb.protocol import keepalive

KEEP = 1.0  # s
# the attached phase: a forked process attaches within the keep-alive of the first
# kill; 1 s was missed on a loaded machine (two runners beside another test file)
KEEP_ATTACHED = 4.0
BOUND = 7.0  # s from the (last) kill past the keep-alive: the agent's 0.5 s tick, the kills
PHASES = ("idle", "busy", "printing", "attached", "collective")


def lonely(group):
    """Rank 0 enters an all_reduce that rank 1 never joins."""
    import torch.distributed as dist

    if mnb.current_rank() == 0:
        dist.all_reduce(torch.ones(1), group=group)


def _busy(mesh) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        st = mesh.status()["ranks"][0]["streams"]["default"]
        if st["running"] is not None and st["running"]["elapsed"] > 0.3:
            return
        time.sleep(0.02)


def controller(phase: str, name: str, ready_fd: int) -> None:
    """The forked controller process."""
    keep = KEEP_ATTACHED if phase == "attached" else KEEP
    mesh = mnb.local_mesh(dp=2 if phase == "collective" else 1, keep_alive=keep, name=name)
    if phase == "busy":
        mesh.exec("while True:\n    pass")
        _busy(mesh)
    elif phase == "printing":
        mesh.exec(
            "import threading\n"
            "def talk():\n"
            "    while True:\n"
            "        print('x' * 100)\n"
            "threading.Thread(target=talk, daemon=True).start()"
        ).fetch(timeout=60)
    elif phase == "collective":
        mnb.remote(lonely)(mesh.process_group("dp"), mesh=mesh)
        _busy(mesh)
    os.write(ready_fd, b"ready\n")
    time.sleep(600)


def attacher(name: str, ready_fd: int) -> None:
    """A second forked controller: attaches, runs a command, waits to be killed."""
    mesh = mnb.attach(name)
    assert mesh.exec("6 * 7").fetch(rank=0, timeout=60) == 42
    os.write(ready_fd, b"ready\n")
    time.sleep(600)


def _fork(target, *args) -> tuple[int, int]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        null = os.open(os.devnull, os.O_WRONLY)  # its ranks' output: not into our JSON lines
        os.dup2(null, 1)
        try:
            target(*args, w)
        except BaseException:
            traceback.print_exc()  # why it never got ready, on the test's stderr
        finally:
            os._exit(1)
    os.close(w)
    return pid, r


def _kill_when_ready(pid: int, r: int, what: str) -> None:
    ready, _, _ = select.select([r], [], [], 180)
    assert ready and os.read(r, 64) == b"ready\n", f"{what} never got ready"
    os.close(r)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def trial(i: int) -> dict:
    phase = PHASES[i % len(PHASES)]
    name = f"expiry{i}"
    pid, r = _fork(controller, phase, name)
    _kill_when_ready(pid, r, f"trial {i}: the controller")
    entry = keepalive.read_entry(name)
    assert entry is not None, f"trial {i}: no registry entry after the kill"
    agent = entry["agent_pid"]
    ranks = [p.pid for p in psutil.Process(agent).children()]
    forked = forkserver_pid(agent) is not None
    if phase == "attached":
        pid, r = _fork(attacher, name)
        _kill_when_ready(pid, r, f"trial {i}: the attaching process")
    keep = KEEP_ATTACHED if phase == "attached" else KEEP
    left, after = gone_within([agent, *ranks], keep + BOUND)
    return {
        "trial": i,
        "phase": phase,
        "agent": agent,
        "forked": forked,
        "ranks": ranks,
        "left": left,
        "after": round(after, 2),
        "entry_left": keepalive.read_entry(name) is not None,
    }


if __name__ == "__main__":
    main(trial)
