"""Which files are the user's own code: the modules a rank's autoreload watches
(worker/autoreload.py), and those that travel to ranks on hosts that do not share
the controller's filesystem (api/code_sync.py, worker/synced_code.py).

A module is the user's when its file lies outside the interpreter's prefixes,
site-packages and monarch_nb itself.
"""

from __future__ import annotations

import os
import site
import sys
import sysconfig

_roots: tuple | None = None


def system_roots() -> tuple:
    """The folders whose modules are not the user's (each ending in a separator)."""
    global _roots
    if _roots is None:
        paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, *site.getsitepackages()}
        paths |= {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
        paths.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # monarch_nb
        user_site = site.getusersitepackages()
        if isinstance(user_site, str):
            paths.add(user_site)
        _roots = tuple(os.path.join(os.path.realpath(p), "") for p in paths if p)
    return _roots


def user_file(name: str, module) -> str | None:
    """The file of ``module`` (imported as ``name``) when it is the user's, else None."""
    if name in ("__main__", "__mp_main__"):
        return None
    f = getattr(module, "__file__", None)
    if not isinstance(f, str) or not os.path.isabs(f):  # (torch.ops names a bare "_ops.py")
        return None
    return None if os.path.realpath(f).startswith(system_roots()) else f


def module_path(name: str, file: str) -> str | None:
    """Where module ``name``'s source goes under a folder on ``sys.path``
    (``pkg/mod.py``, ``pkg/__init__.py``), when ``file`` is such a source; else None
    (a compiled extension, or a module loaded under another name than its path's)."""
    if not file.endswith(".py"):
        return None
    parts = name.split(".")
    if os.path.basename(file) == "__init__.py":
        parts.append("__init__")
    rel = "/".join(parts) + ".py"
    return rel if file.replace(os.sep, "/").endswith("/" + rel) else None


def safe_path(rel: str) -> bool:
    """``rel`` names a Python source inside a folder (no absolute path, no ``..``)."""
    parts = rel.split("/")
    return (
        rel.endswith(".py")
        and not rel.startswith("/")
        and "\\" not in rel
        and all(p and p not in (".", "..") and p.isprintable() for p in parts)
    )
