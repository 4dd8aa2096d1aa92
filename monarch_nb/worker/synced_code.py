"""The user's code files on a rank whose host does not share the controller's
filesystem: ``SyncFiles`` writes them into the mesh's code folder, first on
``sys.path``, before the command that follows (the receiver handles it in message
order, so no later command starts first). A file is written only when its content
(its sha256) differs from what is there, so an unchanged module keeps its mtime
and autoreload leaves it alone; a changed one gets a new mtime and reloads.

Each write is a rename of a complete temporary file: ranks of one host share the
folder, and an import never reads half a file. Each of them holds the folder
(``protocol/held_dirs``) and the last one to exit removes it; a folder whose
ranks were killed goes at the next folder's making.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib
import os
import sys
import tempfile

from ..protocol import held_dirs
from ..protocol.user_files import safe_path

PREFIX = "monarch_nb-code-"

_folders: dict[str, str] = {}  # the message's folder name -> its path here
_origins: dict[str, str] = {}  # a file written here -> the controller's file it copies
_held: dict[str, int | None] = {}  # a folder's path -> this process's hold on it


def origin_of(path: str) -> str:
    """The controller's file that ``path`` copies (``path`` itself if none)."""
    return _origins.get(path, path)


def folder_for(name: str) -> str:
    """The code folder ``name`` on this host, made and put first on ``sys.path``."""
    path = _folders.get(name)
    if path is None:
        if not name.replace("-", "").isalnum():
            raise ValueError(f"bad code folder name {name!r}")
        held_dirs.sweep(PREFIX)  # folders of meshes whose ranks are gone (killed ones too)
        path = os.path.join(tempfile.gettempdir(), PREFIX + name)
        os.makedirs(path, mode=0o700, exist_ok=True)
        _held[path] = held_dirs.hold(path, create=True)  # the ranks of this host share it
        _folders[name] = path
        if path not in sys.path:
            sys.path.insert(0, path)
    return path


@atexit.register
def leave() -> None:
    """As this rank exits (the worker calls it before its ``os._exit``): release its
    code folders, and remove each that no other rank of the host holds."""
    while _held:
        path, held = _held.popitem()
        held_dirs.release(held)
        held_dirs.remove_if_unheld(path)


def write(folder: str, files: tuple, rank: int) -> None:
    """Write ``files`` (``(path, sha256 hex, bytes, the controller's file)``) into
    ``folder``; a file that cannot be written is said on the rank's stderr, and the
    others are written."""
    try:
        root = folder_for(folder)
    except (OSError, ValueError) as e:
        print(f"[code sync] rank {rank}: cannot make the code folder: {e}", file=sys.stderr)
        return
    wrote = False
    for rel, sha, data, origin in files:
        if not safe_path(rel) or hashlib.sha256(data).hexdigest() != sha:
            print(
                f"[code sync] rank {rank}: refused {rel!r} (not a source path or "
                "its content does not match its hash)",
                file=sys.stderr,
            )
            continue
        target = os.path.join(root, *rel.split("/"))
        _origins[target] = str(origin)
        if _sha_of(target) == sha:
            continue
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".sync-")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, target)
            wrote = True
        except OSError as e:
            print(f"[code sync] rank {rank}: cannot write {rel}: {e}", file=sys.stderr)
    if wrote:
        importlib.invalidate_caches()  # a new module is found by the next import


def _sha_of(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None
