"""A pipe's controller end (``mesh.pipe(fn)``): each ``recv()`` is a Ref of the next value."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..protocol import messages as m
from .context import Stream, resolve_target
from .remote import Ref

if TYPE_CHECKING:
    from .mesh import DeviceMesh


class Pipe:
    """A pipe's controller end: ``recv()`` -> Ref; ``close()``."""

    def __init__(self, mesh: DeviceMesh, pipe_id: int):
        self.mesh = mesh
        self.id = pipe_id
        self.closed = False

    def recv(self, stream: Stream | None = None) -> Ref:
        """A Ref holding the next value the pipe sends, on every rank."""
        if self.closed:
            raise ValueError(f"pipe {self.id} is closed")
        _, stream = resolve_target(self.mesh, stream)
        ctrl = self.mesh._controller
        ctrl.check_usable()
        ident, result = ctrl.next_ident(), ctrl.next_id()
        ctrl.send(
            m.PipeRecv(ident, result, self.id, stream.id), self.mesh.targets, stream.id, "pipe recv"
        )
        return Ref(result, self.mesh, stream, ident)

    def close(self) -> None:
        """Stop the side processes."""
        if not self.closed:
            self.closed = True
            ctrl = self.mesh._controller
            if ctrl.usable:
                ctrl.send(m.ClosePipe(self.id), self.mesh.targets)

    def __enter__(self) -> Pipe:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
