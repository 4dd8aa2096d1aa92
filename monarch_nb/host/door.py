"""A kept-alive mesh's door: the Unix socket where its agent waits for a
controller that attaches (``mnb.attach``).

The socket is 0600 in the registry's 0700 directory, and a caller of another
user is refused by its credentials (SO_PEERCRED) as well: only the user who
started the mesh gets in. A caller's first line is an ``Attach``; the socket
then becomes the agent's channel to that controller, as its stdin/stdout were
to the first one.
"""

from __future__ import annotations

import os
import socket
import struct

from ..protocol import host_messages as hm

FIRST_LINE_TIMEOUT = 2.0  # a caller that connects and says nothing is dropped after this
_CRED = struct.Struct("3i")  # pid, uid, gid


class Door:
    """The listening socket at ``path``, 0600 (replacing a stale one); also the fork
    server's (``forkserver.py``: ``kind`` SOCK_SEQPACKET)."""

    def __init__(self, path: str, kind: int = socket.SOCK_STREAM, backlog: int = 4):
        self.path = path
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        self.sock = socket.socket(socket.AF_UNIX, kind)
        old = os.umask(0o177)
        try:
            self.sock.bind(path)
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        self._ino = os.stat(path).st_ino
        self.sock.listen(backlog)
        self.sock.setblocking(False)
        self.fd = self.sock.fileno()

    def knock(self) -> tuple[socket.socket, hm.Attach, int] | None:
        """Accept one caller: (its socket, blocking, its Attach, its pid), or None
        (nobody, another user, or a first line that is not an Attach: refused)."""
        try:
            conn, _ = self.sock.accept()
        except (BlockingIOError, InterruptedError):
            return None
        pid, uid = peer(conn)
        if uid != os.getuid():
            refuse(conn, "this mesh belongs to another user")
            return None
        conn.settimeout(FIRST_LINE_TIMEOUT)
        line = b""
        try:
            while b"\n" not in line and len(line) < 4096:
                part = conn.recv(4096)
                if not part:
                    break
                line += part
        except OSError:
            conn.close()
            return None
        try:
            msg = hm.decode(line.split(b"\n", 1)[0])
        except hm.HostMessageError as e:
            refuse(conn, f"expected an Attach line: {e}")
            return None
        if not isinstance(msg, hm.Attach):
            refuse(conn, f"expected an Attach line, got {type(msg).__name__}")
            return None
        conn.settimeout(None)
        return conn, msg, pid

    def close(self) -> None:
        self.sock.close()
        try:
            if os.stat(self.path).st_ino == self._ino:  # not a later agent's door
                os.unlink(self.path)
        except OSError:
            pass


def peer(conn: socket.socket) -> tuple[int, int]:
    """``(pid, uid)`` of the process at the other end of a Unix socket (SO_PEERCRED)."""
    pid, uid, _ = _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid


def refuse(conn: socket.socket, why: str) -> None:
    """Tell a caller why it is not let in, and hang up."""
    try:
        conn.settimeout(1.0)
        conn.sendall(hm.encode(hm.Refused(why)))
    except OSError:
        pass
    conn.close()
