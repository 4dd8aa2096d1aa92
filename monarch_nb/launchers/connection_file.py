"""The connection file of a ``connect_mesh``: where joining workers and host agents
read the mesh's address and secret (0600, created new, never through a link)."""

from __future__ import annotations

import json
import os
import socket
import stat

from ..protocol import keepalive


def default_connection_file(name: str) -> str:
    """``monarch-mesh-NAME.json`` in the user's Jupyter runtime dir."""
    try:
        from jupyter_core.paths import jupyter_runtime_dir

        base = jupyter_runtime_dir()
    except Exception:
        base = os.path.join(os.path.expanduser("~"), ".local", "share", "jupyter", "runtime")
    os.makedirs(base, mode=0o700, exist_ok=True)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return os.path.join(base, f"monarch-mesh-{safe}.json")


def write_connection_file(
    path: str, address: str, key: bytes, world: int, name: str, dims: dict, agents: str = ""
) -> tuple:
    """Create the file a worker joins with, readable by its owner only (it holds
    the secret): never through a symbolic link, never over an existing file,
    except a connection file left by a controller of this host that is gone.
    Returns the file's (device, inode)."""
    data = {
        "address": address,
        "key": key.hex(),
        "world": world,
        "mesh": name,
        "dims": dims,
        "pid": os.getpid(),
        "host": socket.gethostname(),
    }
    if agents:
        data["agents"] = agents  # the host agents' channel (monarch-nb-host --connection-file)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        if not _remove_if_stale(path):
            raise FileExistsError(_exists_message(path)) from None
        fd = os.open(path, flags, 0o600)
    with os.fdopen(fd, "w") as f:
        try:
            os.fchmod(fd, 0o600)
            st = os.fstat(fd)
            json.dump(data, f)
            f.flush()
        except BaseException:
            os.unlink(path)  # no half-written file with the secret in it
            raise
    return st.st_dev, st.st_ino


def _exists_message(path: str) -> str:
    if os.path.islink(path):
        return (
            f"the connection file {path} is a symbolic link: the mesh's secret is never "
            f"written through one; remove it or pass another connection_file"
        )
    return (
        f"the connection file {path} exists already (another mesh's, or left behind): "
        f"remove it or pass another connection_file"
    )


def _remove_if_stale(path: str) -> bool:
    """Remove ``path`` if it is a connection file of ours whose controller, on this
    host, is gone (a kernel that was killed); True if it was."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size > 1 << 16:
            return False
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd) as f:
            info = json.load(f)
        pid, host = int(info["pid"]), info["host"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if host != socket.gethostname() or pid == os.getpid() or keepalive.process_runs(pid):
        return False
    os.unlink(path)
    return True
