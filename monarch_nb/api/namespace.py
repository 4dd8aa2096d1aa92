"""The commands on the workers' persistent namespaces: exec, run_cell (a notebook
cell as one command), push and pull. A base of DeviceMesh."""

from __future__ import annotations

import hashlib
import re
from typing import Any

from ..protocol import messages as m
from ..protocol.wire import pack_args
from .code_sync import follow_code
from .context import Stream, resolve_target
from .remote import Ref, check_refs


class NamespaceCommands:
    """``exec``, ``run_cell``, ``push`` and ``pull`` of a mesh (``self``: a DeviceMesh)."""

    def exec(self, source: str, *, stream: Stream | None = None) -> Ref:
        """Run ``source`` in each worker's persistent namespace (``rank``, ``size``
        and the mesh coordinates are predefined). Returns a Ref to the value of a
        trailing expression (None when there is none)."""
        if not isinstance(source, str):
            raise TypeError(f"exec() needs source text, got {type(source).__name__}")
        compile(source, "<exec>", "exec")  # a SyntaxError here, not on every worker
        _, stream = resolve_target(self, stream)
        ctrl = self._controller
        ctrl.check_usable(self.targets)
        ident, result = ctrl.next_ident(), ctrl.next_id()
        first = source.strip().splitlines()[0] if source.strip() else ""
        what = f"exec: {first[:40]}"
        ctrl.send(
            m.RunCode(ident, result, source, _exec_filename(source), stream.id, self.id, what),
            self.ranks,
            stream.id,
            what,
        )
        return Ref(result, self, stream, ident)

    def run_cell(
        self,
        source: str,
        *,
        stream: Stream | None = None,
        ranks=None,
        names: dict | None = None,
        auto: dict | None = None,
        filename: str | None = None,
        what: str | None = None,
        timeout: float | None = None,
        before_send=None,
    ):
        """Run notebook-cell ``source`` (IPython syntax: magics, ``!cmd``, ``obj?``)
        on every rank (or on ``ranks``, some of this mesh's) as one command, binding
        ``names`` first (Refs become their per-rank values; ``auto``: bound unless
        worker code defined that name). Returns an AsyncResult of the per-rank
        ``{"data": mimebundle of the last expression or None, "figures": [...],
        "displays": [bundles the cell display()ed]}``; when the cell failed on a
        rank it raises the RemoteError, whose ``results`` still hold every rank's
        figures and displays.
        ``before_send(ident)`` is called with the command's number before it leaves
        (the notebook routes the cell's output by it)."""
        if not isinstance(source, str):
            raise TypeError(f"run_cell() needs source text, got {type(source).__name__}")
        _, stream = resolve_target(self, stream)
        ctrl = self._controller
        ctrl.check_usable(self.targets)
        targets = self.targets if ranks is None else tuple(ranks)
        outside = [r for r in targets if r not in self.targets]
        if outside:
            raise ValueError(f"run_cell(): rank {outside[0]} is not in mesh {self.name!r}")
        args, refs = pack_args((), {"names": names or {}, "auto": auto or {}})
        if refs:
            check_refs(refs, self, stream)
        if what is None:
            first = next((ln.strip() for ln in source.splitlines() if ln.strip()), "")
            what = f"cell: {first[:40]}"
        if "%autoreload" in source and (on := _autoreload_on(source)) is not None:
            follow_code(ctrl, on, None)  # the cell turns the ranks' autoreload on or off
        ident = ctrl.next_ident()
        filename = filename or _exec_filename(source)
        if before_send is not None:
            before_send(ident)
        return ctrl.request(
            m.RunCell(ident, source, filename, args, stream.id, what),
            targets,
            what,
            stream=stream.id,
            label=what,
            timeout=timeout,
            failed_by=ident,
        )

    def autoreload(
        self, on: bool = True, timeout: float | None = 60.0, ship_files: bool | None = None
    ) -> None:
        """Reload the user's changed modules on every rank before each command
        (IPython's ``%autoreload 2`` in each rank's shell, which also covers remote
        functions and ``exec``); ``on=False``: ``%autoreload 0``. ``ship_files``: the
        sources of the kernel's own modules travel to the ranks, changed ones before
        each command (default: on a mesh whose hosts may not share this filesystem,
        ``connect_mesh``'s)."""
        source = "%load_ext autoreload\n%autoreload 2" if on else "%autoreload 0"
        # the cell installs the default (run_cell reads its %autoreload); then the choice
        self.run_cell("# %%monarch\n" + source, what="autoreload").result(timeout=timeout)
        if ship_files is not None:
            follow_code(self._controller, on, ship_files)

    def push(self, **names) -> None:
        """Bind ``names`` in every worker's namespace (Refs become their per-rank values)."""
        ctrl = self._controller
        ctrl.check_usable(self.targets)
        args, refs = pack_args((), names)
        stream = self.default_stream
        check_refs(refs, self, stream)
        ident = ctrl.next_ident()
        ctrl.send(m.SetNames(ident, args, stream.id), self.ranks, stream.id, "push")

    def pull(self, name: str, rank: int | None = None, timeout: float | None = None) -> Any:
        """The value of ``name`` in the workers' namespaces: a list per rank, or one rank's."""
        ctrl = self._controller
        ctrl.check_usable(self.targets)
        ranks = self.ranks if rank is None else [self._global_rank(rank)]
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"pull() needs a variable name, got {name!r}")
        result = ctrl.request(
            m.Pull(ctrl.next_ident(), name, 0),
            ranks,
            f"pull of {name!r}",
            stream=0,
            label=f"pull {name}",
            single=rank is not None,
            timeout=timeout,
        )
        return result.result()


def _exec_filename(source: str) -> str:
    """The name tracebacks and pdb show for ``exec`` source: one per distinct source,
    so that a loop of exec calls does not grow the workers' linecache."""
    digest = hashlib.sha1(source.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"<monarch-exec-{digest}>"


def _autoreload_on(source: str) -> bool | None:
    """Whether the last ``%autoreload`` line of a cell turns it on (IPython: no
    argument or 1, 2, 3, explicit, all, complete; 0 and off turn it off); None
    when no line is one."""
    modes = re.findall(r"^\s*%autoreload\b[ \t]*(\S*)", source, re.M)
    return None if not modes else modes[-1] not in ("0", "off")
