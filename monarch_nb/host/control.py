"""The controller's side of an agent's channel: host_messages lines in, out.

Both agents (forking and simulated) read commands the same way and answer on
the same pipe; what a Spawn or a Kill does is each agent's own (``_spawn``,
``_kill``).
"""

from __future__ import annotations

import functools
import os

from ..protocol import host_messages as hm
from ..protocol.receivers import AGENT, handler_table


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
            except (BrokenPipeError, ConnectionResetError):
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
            handler = self._handlers.get(type(msg))
            if handler is not None:
                handler(msg)
            elif isinstance(msg, hm.HostMessageError):
                self.send(hm.Refused(str(msg)))
            else:
                self.send(hm.Refused(f"{type(msg).__name__} is not a command for an agent"))

    @functools.cached_property
    def _handlers(self) -> dict:
        return handler_table(self, AGENT, prefix="_on_")

    def _on_Spawn(self, msg: hm.Spawn) -> None:
        self._spawn(msg)

    def _on_Kill(self, msg: hm.Kill) -> None:
        self._kill(msg.slot, msg.sig)

    def _on_Quit(self, msg: hm.Quit) -> None:
        self.running = False

    def _spawn(self, msg: hm.Spawn) -> None:
        raise NotImplementedError

    def _kill(self, slot: int, sig: int) -> None:
        raise NotImplementedError
