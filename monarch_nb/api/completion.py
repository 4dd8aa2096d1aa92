"""Completion and inspection from a rank: ``mesh.complete(...)`` and
``mesh.inspect_code(...)``, a part of DeviceMesh (Tab and Shift-Tab in a ``%%monarch``
cell ask them). The rank's IPython shell answers off its streams, so an answer
comes while a cell runs there. And the comms of the ranks' ipywidgets
(``widget_handler``, ``send_widget_event``: notebook/widgets.py bridges them)."""

from __future__ import annotations

from ..protocol import messages as m

TIMEOUT = 1.0  # seconds a rank has to answer (the notebook falls back to the kernel's)


class MeshShell:
    """DeviceMesh's completion and inspection (it has ``_controller``, ``targets``,
    ``_global_rank``)."""

    def complete(
        self,
        code: str,
        cursor_pos: int | None = None,
        rank: int | None = None,
        timeout: float = TIMEOUT,
    ) -> dict:
        """What the IPython Completer of ``rank`` (default: the mesh's first) offers at
        ``cursor_pos`` of ``code`` (default: its end), over that rank's namespace:
        a complete_reply's content (``matches``, ``cursor_start``, ``cursor_end``,
        ``metadata``). Raises TimeoutError after ``timeout`` s, RemoteError when the
        rank's completer failed."""
        pos = _cursor(code, cursor_pos)
        return self._ask_shell(lambda i: m.Complete(i, code, pos), rank, "mesh.complete", timeout)

    def inspect_code(
        self,
        code: str,
        cursor_pos: int | None = None,
        detail_level: int = 0,
        rank: int | None = None,
        timeout: float = TIMEOUT,
    ) -> dict:
        """The help of ``rank``'s IPython shell on the name at ``cursor_pos`` of
        ``code`` (``obj?``; ``detail_level=1``: ``obj??``): an inspect_reply's
        content (``found``, ``data``: its MIME bundle, signature and docstring)."""
        pos = _cursor(code, cursor_pos)
        if detail_level not in (0, 1):
            raise ValueError(f"inspect_code: detail_level is 0 or 1, got {detail_level!r}")
        return self._ask_shell(
            lambda i: m.Inspect(i, code, pos, detail_level), rank, "mesh.inspect_code", timeout
        )

    def _ask_shell(self, make, rank: int | None, what: str, timeout: float) -> dict:
        rank = self.targets[0] if rank is None else self._global_rank(rank)
        ctrl = self._controller
        ctrl.check_usable([rank])
        msg = make(ctrl.next_ident())
        asked = f"{what} on rank {rank}"
        return ctrl.request(msg, [rank], asked, single=True, timeout=timeout).result()


def _cursor(code: str, cursor_pos: int | None) -> int:
    if not isinstance(code, str):
        raise TypeError(f"the code to complete is a str, got {type(code).__name__}")
    if cursor_pos is None:
        return len(code)
    if not isinstance(cursor_pos, int) or not 0 <= cursor_pos <= len(code):
        raise ValueError(f"cursor_pos {cursor_pos!r} is not within the code (0-{len(code)})")
    return cursor_pos
