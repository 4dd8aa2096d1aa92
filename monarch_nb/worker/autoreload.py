"""Code in files: the user's changed modules reloaded before each command, with
IPython's autoreload (``%autoreload 2`` in a ``%%monarch`` cell, or ``%monarch_mesh
--autoreload``, which runs it on every rank).

IPython's extension checks before each *cell*; here its reloader also runs before
every other command (a remote function, ``mesh.exec``, a fetch that calls one).
It watches the modules of the user's own files only: a module whose file is
outside the interpreter's prefixes, site-packages and monarch_nb (checking every
module of a process that imported torch costs ~3 ms; these, microseconds). A
module that fails to reload keeps its old code, and the rank says why in one
line: the file and line of a syntax error, or that its code raised. A changed
compiled extension module cannot be reloaded: the rank says so once; so it does
for a module whose file is gone.
"""

from __future__ import annotations

import os
import sys
import threading

from ..protocol.user_files import user_file
from .synced_code import origin_of

ACTIVE = False  # read by every command: reload before it (set by follow())

_reloader = None  # IPython's ModuleReloader of the rank's shell, while mode 2 is on
_lock = threading.Lock()  # one check at a time (several streams run commands)
_seen = 0  # len(sys.modules) when the user modules were last looked for
_user: set = set()  # names of the user's modules
_binary: dict = {}  # user extension module file -> mtime first seen
_noted: set = set()  # (file, mtime) said once


def _refresh() -> list:
    """Find the user's modules among those imported since the last look (the new ones)."""
    global _seen
    if len(sys.modules) == _seen:
        return []
    new = []
    for name, mod in list(sys.modules.items()):
        if name in _user:
            continue
        f = user_file(name, mod)
        if f is None:
            continue
        _user.add(name)
        new.append(name)
        if not f.endswith(".py"):
            try:
                _binary[f] = os.stat(f).st_mtime
            except OSError:
                pass
    _seen = len(sys.modules)
    return new


def follow(shell) -> None:
    """After a cell: whether the rank's IPython autoreload is on (``%autoreload 2``
    or ``1``); its failures are then said in one line here (hide_errors)."""
    global ACTIVE, _reloader
    magics = shell.magics_manager.registry.get("AutoreloadMagics")
    r = getattr(magics, "_reloader", None)
    with _lock:
        if r is None or not r.enabled:
            ACTIVE, _reloader = False, None
            return
        r.hide_errors = True
        _reloader, ACTIVE = r, True


def before_command() -> None:
    """Reload what changed (ACTIVE only): in mode 2 the user's own modules, in mode 1
    those ``%aimport`` names."""
    r = _reloader
    if r is None:
        return
    with _lock:
        failed = dict(r.failed)
        if r.check_all:  # mode 2: not every module (~3 ms with torch), the user's own
            _refresh()
            saved = r.modules
            r.check_all, r.modules = False, dict.fromkeys(_user, True)
            try:
                r.check()
            finally:
                r.check_all, r.modules = True, saved
        else:
            r.check()
        _report_failures(r, failed)
        _note_binaries_and_gone()


def after_command() -> None:
    """The modules a command imported, as they were then: an edit after it reloads
    (IPython's post_execute does the same for cells)."""
    r = _reloader
    if r is None or len(sys.modules) == _seen:
        return
    with _lock:
        for name in _refresh():
            _, mtime = r.filename_and_mtime(sys.modules.get(name))
            if mtime is not None:
                r.modules_mtimes.setdefault(name, mtime)


def _report_failures(r, before: dict) -> None:
    for path, mtime in r.failed.items():
        if before.get(path) == mtime:
            continue
        try:
            with open(path, encoding="utf-8") as f:
                compile(f.read(), origin_of(path), "exec")  # a copy names the user's file
        except SyntaxError as e:
            why = f"{e.filename}:{e.lineno}: SyntaxError: {e.msg}"
        except OSError as e:
            why = f"{origin_of(path)}: {e}"
        else:
            why = f"{origin_of(path)}: its code raised when reloaded (importlib.reload shows how)"
        print(f"[autoreload] {why}; the module keeps its old code", file=sys.stderr)


def _note_binaries_and_gone() -> None:
    for path, first in list(_binary.items()):
        try:
            now = os.stat(path).st_mtime
        except OSError:
            continue
        if now != first and (path, now) not in _noted:
            _noted.add((path, now))
            print(
                f"[autoreload] {path} changed: a compiled extension module cannot be "
                "reloaded; restart the mesh (%monarch_mesh --restart) to load it",
                file=sys.stderr,
            )
    for name in list(_user):
        mod = sys.modules.get(name)
        f = getattr(mod, "__file__", None)
        if isinstance(f, str) and f.endswith(".py") and not os.path.exists(f):
            if (f, None) not in _noted:
                _noted.add((f, None))
                print(f"[autoreload] {f} is gone: {name} keeps its old code", file=sys.stderr)
