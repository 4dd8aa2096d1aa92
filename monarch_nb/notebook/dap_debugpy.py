"""What debugpy, once JupyterLab's debugger is on, must leave alone.

* Worker processes: debugpy rewrites the command line of every Python process
  the kernel starts to run under pydevd, which waits for a debugger; a mesh
  started then would never come up. Workers are debugged through notebook/dap.py,
  so their command lines (``-m monarch_nb.worker``) are kept as they are.
* monarch_nb's own kernel threads (``monarch-*``: the controllers' IO threads,
  output and UI threads, the adapter's own): when debugpy stops the kernel at a
  breakpoint it suspends every thread it traces, and a suspended IO thread could
  no longer answer the panel's requests on a paused rank (nor keep the mesh
  alive). They are marked as pydevd marks its own threads: neither traced,
  suspended nor listed.
"""

from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor

_WORKER_MODULE = "monarch_nb.worker"
_PREFIX = "monarch-"


def _mark(t: threading.Thread) -> None:
    t.pydev_do_not_trace = True
    t.is_pydev_daemon_thread = True


def keep_threads_running() -> None:
    """Mark monarch_nb's threads of this process (cheap; again as meshes come)."""
    for t in threading.enumerate():
        if t.name.startswith(_PREFIX) and not getattr(t, "is_pydev_daemon_thread", False):
            _mark(t)


def keep_workers_plain() -> None:
    """Leave the workers' command lines alone (once debugpy's process hooks exist)."""
    monkey = sys.modules.get("_pydev_bundle.pydev_monkey")
    orig = getattr(monkey, "patch_args", None)
    if orig is None or getattr(orig, "monarch_keeps_workers", False):
        return

    def patch_args(args, *rest, **kw):
        if isinstance(args, (list, tuple)) and any(str(a) == _WORKER_MODULE for a in args):
            return args
        return orig(args, *rest, **kw)

    patch_args.monarch_keeps_workers = True
    monkey.patch_args = patch_args


def _unmarked_start() -> None:
    _mark(threading.current_thread())


# the adapter's blocking work (worker round trips) runs here, never suspended by debugpy
pool = ThreadPoolExecutor(4, thread_name_prefix="monarch-dap", initializer=_unmarked_start)

__all__ = ["keep_threads_running", "keep_workers_plain", "pool"]
