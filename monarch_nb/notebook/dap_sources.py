"""Sources of remote frames, as JupyterLab's debugger asks for them.

A frame of a ``%%monarch`` cell (``<monarch In[7]>`` on the worker) names the
file ipykernel's ``dumpCell`` gives that cell, written as dumpCell writes it:
JupyterLab finds the cell by it and ``source`` answers from it. A frame whose
file is not on the kernel's host (a worker-only file, ``mesh.exec`` code) is
remembered, and its ``source`` is asked of the worker that showed it (its
linecache); failing that, a clear error.
"""

from __future__ import annotations

import os
import re
import threading

_CELL_FILE = re.compile(r"<monarch In\[(\d+)\](?:#\d+)?>")


class Sources:
    def __init__(self, kernel):
        self.kernel = kernel
        self._lock = threading.Lock()
        self._remote: dict[str, tuple] = {}  # path missing here -> key of a session showing it

    def of_frame(self, path: str, key) -> dict:
        """A remote frame's DAP source."""
        match = _CELL_FILE.fullmatch(path or "")
        if match is not None:
            cell_file = self._cell_file(int(match.group(1)))
            if cell_file is not None:
                return {"name": f"In[{match.group(1)}]", "path": cell_file}
        if path and not os.path.exists(path):
            with self._lock:
                self._remote[path] = key
        return {"name": (path or "?").rsplit("/", 1)[-1], "path": path}

    def _cell_file(self, count: int) -> str | None:
        try:
            from ipykernel.compiler import get_file_name

            code = self.kernel.shell.history_manager.input_hist_raw[count]
            cell_file = get_file_name(code)
            if not os.path.exists(cell_file):
                os.makedirs(os.path.dirname(cell_file), exist_ok=True)
                with open(cell_file, "w", encoding="utf-8") as fh:
                    fh.write(code)
            return cell_file
        except Exception:
            return None  # no such cell in this kernel's history: the plain name

    def remote(self, path: str) -> bool:
        """``path`` was shown for a remote frame and is not on this host."""
        with self._lock:
            return path in self._remote and not os.path.exists(path)

    def content(self, path: str, ask) -> str:
        """The text of ``path``: ``ask(key, path)`` asks the worker that showed it."""
        with self._lock:
            key = self._remote.get(path)
        return ask(key, path)


__all__ = ["Sources"]
