"""The interpreter's switch interval while a mesh's IO thread runs.

A thread that waits for the GIL gets it once the thread holding it has run
``sys.getswitchinterval()`` s of Python (5 ms by default). The IO thread sends what
the user's thread hands over; in a loop of remote calls the user's thread never
stops running Python, so each batch waited up to that long and the workers waited
with it (``python -m benchmarks``' dispatch row: ~75k calls/s at 5 ms, ~100k at
1 ms; a tensor step op by op, whose ops the IO thread batches anyway, unchanged).

So while meshes run here, the process's interval is at most the mesh's
``MonarchNB.switch_interval`` (0: left alone). After the last one it is set back,
unless someone changed it meanwhile (theirs stays).
"""

from __future__ import annotations

import sys
import threading

_lock = threading.Lock()
_holders = [0]
_ours: list = [None]  # (the interval we set last, the one before our first) or None


def holding(run, interval: float):
    """``run`` wrapped: the process's switch interval at most ``interval`` (when > 0)
    while it runs."""

    def held() -> None:
        _hold(interval)
        try:
            run()
        finally:
            _release()

    return held


def _hold(interval: float) -> None:
    with _lock:
        _holders[0] += 1
        now = sys.getswitchinterval()
        if not 0 < interval < now:
            return
        sys.setswitchinterval(interval)
        ours = _ours[0]
        before = now if ours is None or ours[0] != now else ours[1]
        _ours[0] = (sys.getswitchinterval(), before)


def _release() -> None:
    with _lock:
        _holders[0] -= 1
        ours = _ours[0]
        if _holders[0] or ours is None:
            return
        _ours[0] = None
        if sys.getswitchinterval() == ours[0]:  # nobody else changed it meanwhile
            sys.setswitchinterval(ours[1])
