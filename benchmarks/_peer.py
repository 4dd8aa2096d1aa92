"""A peer system driven from a side venv: a ``--serve`` script that answers one JSON
line per command read from its stdin (``peer_monarch.py``, ``peer_ipyparallel.py``).

Every wait is bounded; the peer's stderr is kept for the error messages; closing
asks it to quit and kills it, and every process it started (a peer's engines
may run in sessions of their own, out of its process group), when it will not.
"""

from __future__ import annotations

import json
import queue
import subprocess
import tempfile
import threading

import psutil


class ServePeer:
    """``cmd`` (the peer's ``--serve`` command line) running; ``label`` names it in errors."""

    def __init__(self, label: str, cmd: list, start_timeout: float, command_timeout: float,
                 quit_timeout: float = 60.0) -> None:  # fmt: skip
        self.label, self.command_timeout, self.quit_timeout = label, command_timeout, quit_timeout
        self._err = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(
            [str(c) for c in cmd],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
            cwd=tempfile.gettempdir(),
        )
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True, name=f"{label}-stdout").start()
        try:
            self.info = self._reply(start_timeout, "the peer's start")
        except BaseException:
            self.close(kill=True)
            raise

    def _read(self) -> None:
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _reply(self, timeout: float, what: str) -> dict:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(
                f"{self.label}: no answer to {what} in {timeout:.0f} s; "
                f"stderr: {self.stderr_tail()}"
            ) from None
        if line is None:
            raise RuntimeError(
                f"{self.label} exited (rc {self._proc.wait()}) during {what}; "
                f"stderr: {self.stderr_tail()}"
            )
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{self.label}: {reply['error']}; stderr: {self.stderr_tail()}")
        return reply

    def ask(self, command: str) -> dict:
        """Send one command line; its JSON reply (bounded by the command timeout)."""
        self._proc.stdin.write(f"{command}\n")
        self._proc.stdin.flush()
        return self._reply(self.command_timeout, f"'{command}'")

    def stderr_tail(self, chars: int = 1500) -> str:
        self._err.seek(0)
        text = self._err.read().decode(errors="replace")
        return " | ".join(text[-chars:].strip().splitlines()) or "(empty)"

    def close(self, kill: bool = False) -> None:
        """Ask the peer to quit; kill it and what it started when asked to or when it will not."""
        try:
            if kill:
                raise OSError("kill")
            if self._proc.poll() is None:
                self._proc.stdin.write("quit\n")
                self._proc.stdin.flush()
            self._proc.wait(timeout=self.quit_timeout)
        except (OSError, subprocess.TimeoutExpired):
            try:
                kids = psutil.Process(self._proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                kids = []
            self._proc.kill()
            self._proc.wait()
            for p in kids:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(kids, timeout=30)
        self._err.close()
