"""Waiting in tests: poll for the condition with a bound, never sleep a fixed time."""

from __future__ import annotations

import os
import time

import psutil

INTERVAL = 0.02


def poll(condition, timeout: float, interval: float = INTERVAL):
    """Call ``condition()`` until it returns something truthy or ``timeout`` seconds
    pass; its last value either way."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


def wait_for(condition, timeout: float, what: str, interval: float = INTERVAL, show=None):
    """``condition()``'s first truthy value; after ``timeout`` seconds an AssertionError
    naming ``what`` and the last value seen (or what ``show()`` says then)."""
    value = poll(condition, timeout, interval)
    if not value:
        seen = repr(value) if show is None else str(show())
        if len(seen) > 2000:
            seen = seen[:1000] + " ... " + seen[-1000:]
        raise AssertionError(f"timed out after {timeout} s waiting for {what}; last seen: {seen}")
    return value


def alive(pid: int) -> bool:
    """The process runs (a zombie runs nothing: it counts as gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def pids_gone(pids, timeout: float = 15) -> list[int]:
    """The pids still alive after waiting up to ``timeout`` seconds for them to end."""
    left = list(pids)

    def gone() -> bool:
        left[:] = [p for p in left if alive(p)]
        return not left

    poll(gone, timeout)
    return left


def running(mesh, rank: int, stream: str = "default"):
    """What ``rank`` runs on ``stream`` now, per mesh.status() (None when idle)."""
    return mesh.status()["ranks"][rank]["streams"].get(stream, {}).get("running")


def wait_running(mesh, ranks, stream: str = "default", what: str | None = None, timeout=30.0):
    """Wait until each of ``ranks`` runs a command (whose description starts with
    ``what``) on ``stream``, as the workers report it."""

    def ok():
        for r in ranks:
            cur = running(mesh, r, stream)
            if cur is None or (what is not None and not cur["what"].startswith(what)):
                return False
        return True

    wait_for(
        ok,
        timeout,
        f"ranks {list(ranks)} to run {what or 'a command'} on {stream!r}",
        show=lambda: [running(mesh, r, stream) for r in ranks],
    )


def file_appears(path: str, timeout: float = 60) -> bool:
    """For worker code: wait (bounded) until the test creates ``path``; whether it did.
    A command held on it runs exactly as long as the test wants."""
    return bool(poll(lambda: os.path.exists(path), timeout, 0.01))


def gated_code(gate, before: str, after: str) -> str:
    """Code for a cell run on the workers: print ``before``, wait (60 s at most) for
    the file ``gate``, then print ``after``. The test holds the cell as long as it wants."""
    gate = str(gate)
    return (
        f"import os, time\nprint({before!r})\ndeadline = time.monotonic() + 60\n"
        f"while not os.path.exists({gate!r}) and time.monotonic() < deadline:\n"
        f"    time.sleep(0.01)\nprint({after!r} if os.path.exists({gate!r}) else 'no gate')\n"
    )
