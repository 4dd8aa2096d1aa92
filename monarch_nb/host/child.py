"""Forking one rank from the agent, and what the child does before it is a worker.

The agent is single-threaded when it forks, so the child starts from a clean
process with torch imported. It takes the environment, sys.path and working
directory the controller sent (the agent's own were fixed when it started),
writes its stdout/stderr into a pipe the agent reads, and dies with the agent.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
import traceback
from typing import NoReturn

from ..protocol.host_messages import Spawn


def fork_rank(msg: Spawn, close_in_child: list[int]) -> tuple[int, int]:
    """Fork the rank of ``msg``: (pid, read end of its output pipe). Raises
    OSError when the fork fails (a process limit, no memory)."""
    r, w = os.pipe()
    agent = os.getpid()
    try:
        pid = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        raise
    if pid == 0:  # the rank: never returns
        os.close(r)
        run_child(_become_rank, msg, w, close_in_child, agent)
    os.close(w)
    os.set_blocking(r, False)
    return pid, r


def run_child(become, *args) -> NoReturn:
    """In a forked child: ``become(*args)``, then exit with its SystemExit code (1 after
    anything else, its traceback on stderr), never returning into the parent's code."""
    code = 1
    try:
        become(*args)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        try:
            traceback.print_exc()
            sys.stderr.flush()
        except BaseException:
            pass
    finally:
        os._exit(code)


def reaped():
    """``(pid, exit code)`` of each child that has ended, without waiting (Popen's code:
    -N, killed by signal N)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, os.waitstatus_to_exitcode(status)


def _become_rank(msg: Spawn, out: int, close: list[int], agent: int) -> None:
    os.setsid()  # its own process group: the agent signals the rank and what it forks
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for fd in close:
        try:
            os.close(fd)
        except OSError:
            pass
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)

    from ..worker.__main__ import run_worker, set_parent_death_signal

    set_parent_death_signal(agent)  # SIGKILL when the agent goes
    argv = ["monarch_nb.worker", f"--rank={msg.rank}", f"--world={msg.world}"]
    set_title(argv, f"mnb-rank{msg.rank}")  # first: it finds its room by the environment's
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in msg.env.items()})
    sys.path[:] = [str(p) for p in msg.sys_path]
    tempfile.tempdir = None  # found again from this env's TMPDIR (the agent may have cached one)
    if hasattr(time, "tzset"):
        time.tzset()  # this env's TZ
    sys.argv = argv
    try:
        os.chdir(msg.cwd)
    except OSError as e:
        print(f"[monarch worker {msg.rank}] cannot enter {msg.cwd}: {e}", file=sys.stderr)
    _apply_threads(msg.env.get("OMP_NUM_THREADS"))
    _fresh_randomness()
    run_worker(
        msg.address, bytes.fromhex(msg.key_hex), msg.rank, msg.world, msg.local_rank, agent, None
    )


def set_title(argv: list[str], name: str) -> None:
    """What ``ps`` and ``top`` show of a forked process: the command line that would
    have started it (``python -m monarch_nb.worker --rank=1 --world=2``, not the
    fork server's) and ``name`` as its short name (``mnb-rank1``). Called before the
    environment changes (setproctitle extends argv's memory over the original
    environment's). Best effort: a host without setproctitle keeps the parent's."""
    try:
        from setproctitle import setproctitle, setthreadtitle
    except ImportError:
        return
    setproctitle(" ".join(["python", "-m", *argv]))
    setthreadtitle(name)  # the main thread's name is the process's (/proc/PID/comm)


def _apply_threads(value) -> None:
    """OpenMP read OMP_NUM_THREADS when the agent loaded torch: set it for this
    rank as a fresh process would have read it."""
    if not value:
        return
    try:
        n = int(str(value).split(",")[0])
    except ValueError:
        return
    if n >= 1:
        import torch

        torch.set_num_threads(n)


def _fresh_randomness() -> None:
    """Seeds of its own, as a fresh process draws them: a fork copies the agent's
    (Python's random reseeds itself after a fork; torch's CPU generator and numpy's
    global one do not). CUDA's generators are made in the child, seeded as usual.
    Python's hash seed stays the agent's: every rank of a host hashes alike."""
    import torch

    torch.default_generator.seed()
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        np_random.seed()
