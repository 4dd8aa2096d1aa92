"""The user's code travels to ranks on hosts that do not share this filesystem
(agents and workers that joined over ``connect_mesh``/``--connect``): with
autoreload on, each command is preceded by the sources of the kernel's own
modules that changed since the ranks last got them.

Content-addressed: a file goes when its sha256 differs from the one this mesh
generation's ranks have (a stat per module per command finds the candidates: only
a new mtime or size is read and hashed). The ranks write them into a per-mesh
folder first on their ``sys.path`` (``worker/synced_code.py``), where their
autoreload sees the new mtime and reloads. The modules are those of the kernel's
``sys.modules`` that are the user's (``protocol/user_files``): a module the ranks
import and the kernel never did does not travel.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import sys
import warnings

from ..protocol import messages as m
from ..protocol.user_files import module_path, user_file

MAX_FILE = 8 << 20  # bytes: a bigger source is not sent (said once)


class CodeSync:
    """The controller's ``before_command`` hook of one mesh: sends SyncFiles."""

    def __init__(self, ctrl):
        self.ctrl = ctrl
        self.folder = secrets.token_hex(8)  # the mesh's code folder on each host
        self.generation = -1
        self._seen = 0  # len(sys.modules) at the last look
        self._files: dict[str, str] = {}  # path under the folder -> the kernel's file
        self._stat: dict[str, tuple] = {}  # path -> (mtime_ns, size) when last hashed
        self._sent: dict[str, str] = {}  # path -> sha256 the ranks have
        self._warned: set = set()

    def __call__(self) -> None:
        ctrl = self.ctrl
        if ctrl.generation != self.generation:  # fresh ranks have nothing
            self.generation, self._sent, self._stat = ctrl.generation, {}, {}
        if len(sys.modules) != self._seen:
            self._find_modules()
        files = self.changed()
        if files:
            ctrl.send(m.SyncFiles(self.folder, tuple(files)), None, check=False)

    def changed(self) -> list:
        """``(path, sha256, bytes, file)`` of each source whose content the ranks lack."""
        out = []
        for rel, file in self._files.items():
            try:
                st = os.stat(file)
            except OSError:
                continue  # gone: the ranks keep their copy (and their module its code)
            stamp = (st.st_mtime_ns, st.st_size)
            if self._stat.get(rel) == stamp:
                continue
            if st.st_size > MAX_FILE:
                self._warn(file, f"{st.st_size} bytes, more than {MAX_FILE}")
                continue
            try:
                with open(file, "rb") as f:
                    data = f.read()
            except OSError as e:
                self._warn(file, str(e))
                continue
            self._stat[rel] = stamp
            sha = hashlib.sha256(data).hexdigest()
            if self._sent.get(rel) != sha:
                self._sent[rel] = sha
                out.append((rel, sha, data, file))
        return out

    def _find_modules(self) -> None:
        for name, mod in list(sys.modules.items()):
            file = user_file(name, mod)
            rel = file and module_path(name, file)
            if rel and rel not in self._files:
                self._files[rel] = file
        self._seen = len(sys.modules)

    def _warn(self, file: str, why: str) -> None:
        if file not in self._warned:
            self._warned.add(file)
            warnings.warn(f"{file} does not travel to the mesh's hosts: {why}", stacklevel=2)


def follow_code(ctrl, on: bool, ship: bool | None) -> None:
    """Install (``on``) or remove the mesh's CodeSync; ``ship`` None: when the mesh's
    ranks may not share this filesystem (its launcher says so)."""
    if ship is None:
        ship = not ctrl.workers.launcher.shares_files
    if on and ship:
        if not isinstance(ctrl.before_command, CodeSync):
            ctrl.before_command = CodeSync(ctrl)
    elif isinstance(ctrl.before_command, CodeSync):
        ctrl.before_command = None
