"""The controller's side of an agent's channel: host_messages lines in, out.

Both agents (forking and simulated) read commands the same way and answer on
the same pipe; what a Spawn or a Kill does is each agent's own (``_spawn``,
``_kill``).
"""

from __future__ import annotations

import os

from ..protocol import host_messages as hm


class ControlChannel:
    """``send`` and ``_read_control`` over ``ctl_in`` / ``ctl_out`` (set by the agent)."""

    ctl_in: int
    ctl_out: int
    reader: hm.LineReader
    running: bool

    def send(self, msg) -> None:
        data = memoryview(hm.encode(msg))
        while data:
            try:
                n = os.write(self.ctl_out, data)
            except BrokenPipeError:
                self.running = False
                return
            data = data[n:]

    def _read_control(self) -> None:
        try:
            data = os.read(self.ctl_in, 1 << 16)
        except OSError:
            data = b""
        if not data:
            self.running = False  # the controller closed its end: it is gone
            return
        for msg in self.reader.feed(data):
            if isinstance(msg, hm.HostMessageError):
                self.send(hm.Refused(str(msg)))
            elif isinstance(msg, hm.Spawn):
                self._spawn(msg)
            elif isinstance(msg, hm.Kill):
                self._kill(msg.slot, msg.sig)
            elif isinstance(msg, hm.Quit):
                self.running = False
            else:
                self.send(hm.Refused(f"{type(msg).__name__} is not a command for an agent"))

    def _spawn(self, msg: hm.Spawn) -> None:
        raise NotImplementedError

    def _kill(self, slot: int, sig: int) -> None:
        raise NotImplementedError
