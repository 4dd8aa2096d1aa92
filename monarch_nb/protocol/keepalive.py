"""Kept-alive meshes: the duration ``keep_alive="30m"`` and the registry of live ones.

A mesh started with ``local_mesh(..., keep_alive=D)`` has a host agent of its own
that outlives its controller by ``D``. Each such mesh has one JSON entry, mode
0600, in a 0700 directory (``MONARCH_NB_MESH_DIR``, else ``monarch-nb-meshes`` in
the Jupyter runtime dir): its name, ranks, agent pid, controller pid, times and
key. The controller writes it at launch; the agent marks it orphaned when its
controller goes and removes it when it ends. ``monarch-nb list`` and
``monarch-nb kill NAME`` read it.

A ``connect_mesh(..., keep_alive=D)`` mesh's agents run on other hosts (``"remote":
true``, no agent pid here): its controller touches the entry at each heartbeat,
so once that process is gone the entry's mtime says when, and the mesh counts as
live until its relays' keep-alive has passed from then.
"""

from __future__ import annotations

import json
import os
import re
import time

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhd]?)\s*$")


def parse_keep_alive(value) -> float:
    """Seconds from ``"30m"``, ``"3s"``, ``"1.5h"``, ``"2d"`` or a number of seconds;
    ValueError naming the value for 0, a negative or a nonsense duration."""
    if isinstance(value, bool):
        raise ValueError(f"keep_alive={value!r}: expected a duration such as '30m' or '3s'")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        m = _DURATION.match(value.lower())
        if m is None:
            raise ValueError(
                f"keep_alive={value!r} is not a duration: expected a number with s, m, h "
                "or d, such as '30m' or '3s'"
            )
        seconds = float(m.group(1)) * _UNITS[m.group(2)]
    else:
        raise ValueError(f"keep_alive={value!r}: expected a duration such as '30m' or '3s'")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(
            f"keep_alive={value!r}: must be a positive duration (leave it out, or None, "
            "for a mesh that ends with its kernel)"
        )
    return seconds


def registry_dir(create: bool = True) -> str:
    """The directory of kept-alive meshes' entries (0700, made when ``create``)."""
    base = os.environ.get("MONARCH_NB_MESH_DIR")
    if not base:
        try:
            from jupyter_core.paths import jupyter_runtime_dir

            root = jupyter_runtime_dir()
        except Exception:
            root = os.path.join(os.path.expanduser("~"), ".local", "share", "jupyter", "runtime")
        base = os.path.join(root, "monarch-nb-meshes")
    if create:
        os.makedirs(base, mode=0o700, exist_ok=True)
        os.chmod(base, 0o700)
    return base


def entry_path(name: str) -> str:
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"{name!r} is not a mesh name")
    return os.path.join(registry_dir(), f"{name}.json")


def door_path(name: str) -> str:
    """Where the agent of kept-alive mesh ``name`` listens for a controller that
    attaches: a Unix socket in the registry directory, or (a path too long for a
    socket address) in a 0700 directory of this user's under the temp directory."""
    path = entry_path(name)[: -len(".json")] + ".sock"
    if len(path.encode()) <= 100:
        return path
    import hashlib
    import tempfile

    short = os.path.join(tempfile.gettempdir(), f"mnb-{os.getuid()}")
    os.makedirs(short, mode=0o700, exist_ok=True)
    if os.stat(short).st_uid != os.getuid():
        raise PermissionError(f"{short} belongs to another user")
    os.chmod(short, 0o700)
    return os.path.join(short, hashlib.sha256(path.encode()).hexdigest()[:20] + ".sock")


def write_entry(name: str, entry: dict) -> str:
    """Write (replace) the entry of mesh ``name``, mode 0600; returns its path."""
    path = entry_path(name)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(entry, f)
    os.replace(tmp, path)
    return path


def read_entry(name: str) -> dict | None:
    """The entry of a live mesh ``name``, or None (an entry whose agent is gone is removed)."""
    try:
        with open(entry_path(name)) as f:
            entry = json.load(f)
    except (OSError, ValueError):
        return None
    if not (remote_alive(entry) if entry.get("remote") else agent_alive(entry)):
        remove_entry(name)
        return None
    return entry


def update_entry(name: str, **fields) -> None:
    """Set ``fields`` in the entry of ``name`` (nothing when there is none)."""
    try:
        with open(entry_path(name)) as f:
            entry = json.load(f)
    except (OSError, ValueError):
        return
    entry.update(fields)
    write_entry(name, entry)


def touch_entry(path: str) -> None:
    """Mark that the controller of the remote mesh whose entry is at ``path``
    (``entry_path``) is still here: the entry's mtime."""
    try:
        os.utime(path)
    except OSError:
        pass


def remove_entry(name: str) -> None:
    try:
        os.unlink(entry_path(name))
    except (OSError, ValueError):
        pass


def live_entries() -> list[dict]:
    """Every live kept-alive mesh of this user, by name (stale entries removed)."""
    out = []
    for f in sorted(os.listdir(registry_dir())):
        if f.endswith(".json"):
            entry = read_entry(f[: -len(".json")])
            if entry is not None:
                out.append(entry)
    return out


def agent_alive(entry: dict) -> bool:
    """Whether the entry's agent runs (its pid, and a host agent's command line)."""
    pid = entry.get("agent_pid")
    if not process_runs(pid):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"monarch_nb.host" in f.read()
    except OSError:
        return False


def process_runs(pid) -> bool:
    """Whether process ``pid`` runs (and is not a zombie)."""
    if not isinstance(pid, int):
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def orphaned_at(entry: dict) -> float | None:
    """When the mesh's controller went (wall time), or None while it has the mesh."""
    if not entry.get("remote") or entry.get("orphaned_at") is not None:
        return entry.get("orphaned_at")  # a local mesh's agent, or a detach, said so
    if process_runs(entry.get("controller_pid")):
        return None
    try:
        return os.stat(entry_path(entry["name"])).st_mtime
    except OSError:
        return 0.0


def remote_alive(entry: dict) -> bool:
    """Whether a remote mesh's relays may still wait (its keep-alive, from when its
    controller went, and the heartbeat timeout they take to notice, have not passed)."""
    gone = orphaned_at(entry)
    if gone is None:
        return True
    return time.time() < gone + entry["keep_alive"] + entry.get("heartbeat_timeout", 10.0) + 2


def describe(entry: dict, now: float | None = None) -> dict:
    """The columns ``monarch-nb list`` shows: name, ranks, age, idle, controller."""
    now = time.time() if now is None else now
    orphaned = orphaned_at(entry)
    idle = now - orphaned if orphaned else 0.0
    left = entry["keep_alive"] - idle if orphaned else entry["keep_alive"]
    return {
        "name": entry["name"],
        "ranks": entry["world"],
        "age": now - entry["created"],
        "idle": idle,
        "controller": entry.get("controller_pid"),
        "attached": not orphaned,
        "expires_in": max(0.0, left),
    }


def fmt_seconds(s: float) -> str:
    s = int(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
