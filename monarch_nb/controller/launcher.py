"""Launchers start worker processes. LocalLauncher: one process per rank on this host."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import deque


def _visible_gpus() -> list[str]:
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    try:
        n = torch.cuda.device_count()
    except Exception:
        return []
    if n == 0:
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [d.strip() for d in visible.split(",") if d.strip()][:n]
    return [str(i) for i in range(n)]


class LocalProcess:
    """One locally started worker: its Popen and the tail of what it printed."""

    TAIL_LINES = 60

    def __init__(self, rank: int, popen: subprocess.Popen):
        self.rank = rank
        self.popen = popen
        self.fd = popen.stdout.fileno() if popen.stdout is not None else None
        self.tail: deque[str] = deque(maxlen=self.TAIL_LINES)
        self._partial = b""

    @property
    def pid(self) -> int:
        return self.popen.pid

    def read_output(self) -> bool:
        """Read what is available from the worker's stdout/stderr pipe; False at EOF."""
        if self.fd is None:
            return False
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        if not data:
            if self._partial:
                self.tail.append(self._partial.decode("utf-8", "replace"))
                self._partial = b""
            self.fd = None
            return False
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            self.tail.append(line.decode("utf-8", "replace"))
        if len(self._partial) > 8192:
            self.tail.append(self._partial.decode("utf-8", "replace"))
            self._partial = b""
        return True

    def tail_text(self) -> str:
        return "\n".join(self.tail)

    def kill(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            try:
                self.popen.send_signal(sig)
            except ProcessLookupError:
                pass


class LocalLauncher:
    """Starts ``world`` workers on this host, one GPU each when GPUs are present."""

    def launch(self, address: str, key: bytes, world: int) -> dict[int, LocalProcess]:
        gpus = _visible_gpus()
        base = dict(os.environ)
        base.pop("MONARCH_NB_KEY", None)
        # the workers import what the controller imports, from the same places
        paths = [p if p else os.getcwd() for p in sys.path]
        base["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        base["PYTHONUNBUFFERED"] = "1"
        if "OMP_NUM_THREADS" not in os.environ:
            base["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world))
        # glibc maps allocations over 32 MiB afresh each time (and unmaps them on free):
        # every large result tensor would pay for ~16k page faults. Keep them on the
        # heap and reuse them, as a caching allocator would.
        base.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 30))
        base.setdefault("MALLOC_TRIM_THRESHOLD_", str(1 << 30))
        procs = {}
        for rank in range(world):
            env = dict(base)
            env.update(
                RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world),
            )
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = gpus[rank % len(gpus)]
            cmd = [
                sys.executable,
                "-m",
                "monarch_nb.worker",
                "--connect",
                address,
                "--key-stdin",
                "--parent-pid",
                str(os.getpid()),
            ]
            popen = subprocess.Popen(
                cmd,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a terminal's Ctrl-C goes to the controller only
                close_fds=True,
            )
            popen.stdin.write(key.hex().encode() + b"\n")
            popen.stdin.close()
            os.set_blocking(popen.stdout.fileno(), False)
            procs[rank] = LocalProcess(rank, popen)
        return procs
