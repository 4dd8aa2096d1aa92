"""DeviceMesh: named dims over a slice of ranks, and the user's handle on a mesh."""

from __future__ import annotations

import contextlib
import os

from ..controller import Controller
from ..controller.errors import MeshClosedError, RemoteError
from ..controller.replies import print_output
from ..protocol import messages as m
from ..protocol.ndslice import NDSlice
from ..protocol.wire import RefUseError, function_ref, pack_args
from . import checkpoint, context
from .checkpoint import MeshCheckpoints
from .completion import MeshShell
from .context import BaseMesh, Stream, all_meshes, get_mesh, resolve_target
from .insight import MeshInsight
from .namespace import NamespaceCommands
from .pipe import Pipe
from .remote import ProcessGroup
from .widgets import MeshWidgets


class DeviceMesh(
    NamespaceCommands, MeshInsight, MeshShell, MeshWidgets, MeshCheckpoints, BaseMesh
):
    """Ranks arranged on named dims. ``local_mesh(dp=2)`` makes one."""

    def __init__(
        self, controller: Controller, mesh_id: int, names: tuple, ranks: NDSlice, name: str
    ):
        self._controller = controller
        self.id = mesh_id
        self._names = tuple(names)
        self._slice = ranks
        self._ranks: tuple | None = None
        self.name = name
        self._default_stream: Stream | None = None

    # ------------------------------------------------------------ shape

    @property
    def dims(self) -> dict:
        """``{"dp": 2}``: dim names and sizes, in order."""
        return dict(zip(self._names, self._slice.sizes))

    @property
    def size(self) -> int:
        return len(self._slice)

    @property
    def ranks(self) -> list:
        """The global ranks of this mesh, in row-major order of its dims."""
        return list(self.targets)

    @property
    def targets(self) -> tuple:
        """``ranks`` as a tuple, computed once (commands are addressed to it)."""
        r = self._ranks
        if r is None:
            r = self._ranks = tuple(self._slice.ranks())
        return r

    @property
    def backend(self) -> str:
        return self._controller.state.backend

    @property
    def device_type(self) -> str:
        """``"cuda"`` when every worker has a GPU (mesh tensors default to it), else ``"cpu"``."""
        return "cuda" if self._controller.workers.all_cuda() else "cpu"

    def coords(self, rank: int) -> dict:
        """The coordinates of global ``rank`` on this mesh's dims."""
        c = self._slice.coordinates(rank)
        if c is None:
            raise ValueError(f"rank {rank} is not in mesh {self.name!r} (ranks {self.ranks})")
        return dict(zip(self._names, c))

    def _global_rank(self, rank: int) -> int:
        if not isinstance(rank, int) or rank not in self.targets:
            raise ValueError(f"rank {rank!r} is not in mesh {self.name!r} (ranks {self.ranks})")
        return rank

    def slice(self, **dims) -> DeviceMesh:
        """A sub-mesh: ``dp=0`` keeps one index and drops the dim; ``dp=slice(0, 2)`` keeps it."""
        offset = self._slice.offset
        names, sizes, strides = [], [], []
        for n in dims:
            if n not in self._names:
                raise ValueError(f"mesh {self.name!r} has no dim {n!r} (dims: {list(self._names)})")
        for n, size, stride in zip(self._names, self._slice.sizes, self._slice.strides):
            sel = dims.get(n)
            if sel is None:
                names.append(n)
                sizes.append(size)
                strides.append(stride)
            elif isinstance(sel, int) and not isinstance(sel, bool):
                i = sel + size if sel < 0 else sel
                if not 0 <= i < size:
                    raise IndexError(f"index {sel} out of range for dim {n!r} of size {size}")
                offset += i * stride
            elif isinstance(sel, slice):
                start, stop, step = sel.indices(size)
                count = len(range(start, stop, step))
                if count == 0:
                    raise IndexError(f"slice {sel} of dim {n!r} (size {size}) is empty")
                offset += start * stride
                names.append(n)
                sizes.append(count)
                strides.append(stride * step)
            else:
                raise TypeError(f"dim {n!r}: expected an int or a slice, got {type(sel).__name__}")
        return self._derive(tuple(names), NDSlice(offset, tuple(sizes), tuple(strides)))

    def rename(self, **names: str) -> DeviceMesh:
        """The same ranks with dims renamed: ``mesh.rename(dp="data")``."""
        for old, new in names.items():
            if old not in self._names:
                raise ValueError(
                    f"mesh {self.name!r} has no dim {old!r} (dims: {list(self._names)})"
                )
            if not isinstance(new, str) or not new.isidentifier():
                raise ValueError(f"new dim name {new!r} is not an identifier")
        renamed = tuple(names.get(n, n) for n in self._names)
        if len(set(renamed)) != len(renamed):
            raise ValueError(f"renaming gives duplicate dims: {list(renamed)}")
        return self._derive(renamed, self._slice)

    def flatten(self, name: str) -> DeviceMesh:
        """All dims merged into one called ``name`` (row-major rank order)."""
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"dim name {name!r} is not an identifier")
        sizes, strides = self._slice.sizes, self._slice.strides
        for i in range(len(sizes) - 1):
            if strides[i] != strides[i + 1] * sizes[i + 1]:
                raise ValueError(
                    f"mesh {self.name!r} is not contiguous: its dims cannot be flattened"
                )
        stride = strides[-1] if strides else 1
        return self._derive((name,), NDSlice(self._slice.offset, (self.size,), (stride,)))

    def _derive(self, names: tuple, ranks: NDSlice) -> DeviceMesh:
        ctrl = self._controller
        ctrl.check_usable(ranks)
        mesh_id = ctrl.next_id()
        ctrl.send(m.CreateDeviceMesh(mesh_id, tuple(names), ranks), None)
        return DeviceMesh(ctrl, mesh_id, tuple(names), ranks, self.name)

    # ------------------------------------------------------------ streams, activation

    def stream(self, name: str) -> Stream:
        """The stream called ``name`` on every worker (created on first use)."""
        if not isinstance(name, str) or not name:
            raise ValueError("a stream name must be a non-empty string")
        ctrl = self._controller
        sid = ctrl.streams.get(name)
        if sid is None:
            ctrl.check_usable(self.targets)
            sid = ctrl.next_id()
            ctrl.send(m.CreateStream(sid, name, False), None)
            ctrl.streams[name] = sid
            ctrl.state.add_stream(sid, name)
        return Stream(self, sid, name)

    @property
    def default_stream(self) -> Stream:
        s = self._default_stream
        if s is None:  # made once: every tensor op names it
            s = self._default_stream = Stream(self, 0, "default")
        return s

    @contextlib.contextmanager
    def activate(self):
        """Within this block, calls without ``mesh=`` go to this mesh."""
        with context.activated("meshes", self):
            yield self

    def wait(self, timeout: float | None = None) -> None:
        """Block until every command sent so far has finished on every stream; raise
        a RemoteError for failures not raised yet."""
        ctrl = self._controller
        ctrl.check_usable(self.targets)
        ctrl.request(
            m.RequestStatus(ctrl.next_ident()), self.ranks, "wait", statuses=True, timeout=timeout
        ).result()
        err = ctrl.failures.take_unreported()
        if err is not None:
            raise err

    def pipe(self, fn, *args, max_messages: int = 50, **kwargs) -> Pipe:
        """Start a side process per rank running ``fn(pipe, *args, **kwargs)``; it
        sends values with ``pipe.send(v)`` (a data loader) and ``pipe.recv()``
        here gives a Ref with the next value on each rank. At most
        ``max_messages`` values wait unreceived (the sender blocks). A crash or
        an exception in ``fn`` reaches the caller as RemoteError; pipes end with
        their mesh."""
        if not isinstance(max_messages, int) or max_messages < 1:
            raise ValueError(f"max_messages must be a positive int, got {max_messages!r}")
        ctrl = self._controller
        ctrl.check_usable()
        function = function_ref(fn)
        packed, refs = pack_args(args, kwargs)
        if refs:
            raise RefUseError(
                "a pipe's arguments are sent to another process: pass values, not Refs"
            )
        pipe_id = ctrl.next_id()
        ctrl.send(m.CreatePipe(pipe_id, function, packed, max_messages), self.targets)
        return Pipe(self, pipe_id)

    def tensor(self, source, split=None):
        """An ``mnb.Tensor`` of the workers' variable ``source``, or of a local tensor, array
        or list on every rank (``split="dp"``: dim 0 in a chunk per coordinate)."""
        from .tensor.sources import as_mesh_tensor  # loads torch: only when asked
        return as_mesh_tensor(self, source, split)

    def process_group(self, dims) -> ProcessGroup:
        """A handle that a remote function receives as the torch.distributed group
        over ``dims`` (a name or several) for the stream the call runs on."""
        dims = (dims,) if isinstance(dims, str) else tuple(dims)
        for d in dims:
            if d not in self._names:
                raise ValueError(
                    f"unknown dim {d!r}: mesh {self.name!r} has dims {list(self._names)}"
                )
        if not dims:
            raise ValueError("process_group() needs at least one dim")
        return ProcessGroup(self, dims)

    @property
    def debugger(self):
        """The paused debugger sessions of this mesh's workers (remote pdb)."""
        return self._controller.debugger

    def interrupt(self, timeout: float | None = None) -> None:
        """Raise KeyboardInterrupt in whatever runs on this mesh's workers. With
        ``timeout``, wait that long for the running commands to stop; ranks stuck
        outside Python code (a collective whose peer is gone, a long native call)
        raise ``mnb.InterruptTimeout`` naming them: ``mesh.restart()`` frees them."""
        if timeout is None:
            self._controller.interrupt(ranks=self.ranks)
        else:
            self._controller.interrupts.interrupt_and_wait(timeout=timeout, ranks=self.ranks)

    def status(self) -> dict:
        """Plain data: workers, streams, errors and debugger sessions (MeshState)."""
        return self._controller.state.snapshot()

    def stacks(self, timeout: float = 5.0) -> dict:
        """Where every rank is, to find a hang: rank -> {stream name: {"running":
        what the stream runs or None, "stack": its Python frames (the worker's own
        hidden; "" when idle)}}. A rank that does not answer within ``timeout`` s
        (stopped, or in native code that holds the GIL) maps to None."""
        ctrl = self._controller
        ctrl.check_usable()
        asked = {
            r: ctrl.request(
                m.RequestStacks(ctrl.next_ident()), [r], "stacks", single=True, timeout=timeout
            )
            for r in self.ranks
        }
        out = {}
        for r, result in asked.items():
            try:
                out[r] = result.result()
            except TimeoutError:
                out[r] = None
        return out

    def dashboard(self):
        """The ipywidgets dashboard of this mesh (a ``monarch_nb.ui.Dashboard``)."""
        return context.dashboard(self)

    # ------------------------------------------------------------ for front ends
    # What the notebook layer and the dashboards use beyond the calls above
    # (docs/api.md, "For front ends"); a slice shares its mesh's.

    @property
    def key(self) -> int:
        """This mesh's identity: the same for its slices and across restarts; a new
        mesh (even of the same name) has another, never reused in this process."""
        return self._controller.key

    @property
    def generation(self) -> int:
        """0 for the first workers, +1 per ``restart()``."""
        return self._controller.generation

    @property
    def streams(self) -> dict:
        """The streams made so far (``"default"`` and every ``stream(name)``), by name."""
        return {n: Stream(self, sid, n) for n, sid in list(self._controller.streams.items())}

    def check_usable(self) -> None:
        """Return if this mesh's ranks can take commands, else raise why:
        MeshClosedError (shut down), WorkerCrashed (a rank died), RemoteError (broken)."""
        self._controller.check_usable(self.targets)

    def failure_of(self, ident: int) -> RemoteError | None:
        """The failures reported so far of command ``ident`` (``AsyncResult.ident``) as
        one RemoteError, or None; once returned they count as raised (``wait()``)."""
        return self._controller.failures.error(ident, "")

    @property
    def output_handler(self):
        """``fn(Output)``, called on the IO thread with every chunk of worker output
        (``rank``, ``name``: "stdout" / "stderr", ``text``, ``ident``: the command's or None);
        by default it prints. Setting None prints again."""
        return self._controller.on_output

    @output_handler.setter
    def output_handler(self, fn) -> None:
        self._controller.on_output = print_output if fn is None else fn

    @property
    def liveness_listeners(self) -> list:
        """Callables ``fn(event, info)`` told on the IO thread when a worker goes silent
        past the heartbeat timeout (``"unresponsive"``) and when it answers again
        (``"recovered"``); ``info``: rank, host, pid, silent_for (seconds)."""
        return self._controller.liveness.listeners

    # ------------------------------------------------------------ life cycle

    def _whole(self, what: str) -> None:
        """Life-cycle calls act on whole meshes: a slice says so instead of acting."""
        if self.id != 0:
            raise ValueError(
                f"{what} acts on the whole mesh {self.name!r}, and this is a slice of it "
                f"(ranks {list(self.ranks)}): call it on mnb.get_mesh({self.name!r})"
            )

    def restart(self, restore=None, setup: str | None = None) -> None:
        """Fresh workers on every rank (not a slice's); old Refs become invalid.
        ``restore=PATH``: then ``setup`` (code that builds and shards FSDP2 or TP
        modules) and a load of PATH, checked before the old workers go."""
        self._whole("restart()")
        if restore is not None or setup is not None:
            checkpoint.restart_and_load(self, restore, setup)
            return
        self._controller.restart()

    def shutdown(self) -> None:
        """Stop every worker of this mesh (a slice refuses): nothing is left running."""
        self._whole("shutdown()")
        self._controller.shutdown()
        context.forget(self)

    def detach(self) -> None:
        """Let go of a kept-alive mesh, its workers running on for ``mnb.attach``."""
        self._whole("detach()")
        if self._controller.workers.launcher.keep_alive is None:
            raise ValueError(f"mesh {self.name!r} is not kept alive: its workers end with it")
        self._controller.detach(f"this process (pid {os.getpid()}) detached it")
        context.forget(self)

    @property
    def alive(self) -> bool:
        return self._controller.usable

    @property
    def closed(self) -> bool:
        """Shut down for good (a broken or restarting mesh is not ``alive`` but not closed)."""
        return self._controller.closed

    def __enter__(self) -> DeviceMesh:
        self._whole("'with mesh:' (a shutdown at its end)")
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        dims = ", ".join(f"{k}={v}" for k, v in self.dims.items())
        return f"<DeviceMesh {self.name!r} {dims} ranks={self.ranks} backend={self.backend}>"

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{k}</th>" for k in self._names)
        rows = "".join(
            "<tr><td>{}</td>{}</tr>".format(
                r, "".join(f"<td>{c}</td>" for c in self.coords(r).values())
            )
            for r in self.ranks
        )
        return (
            f"<div><b>{self.name}</b> ({self.backend}, {self.size} ranks)"
            f"<table><tr><th>rank</th>{head}</tr>{rows}</table></div>"
        )


__all__ = [
    "DeviceMesh",
    "MeshClosedError",
    "Pipe",
    "Stream",
    "all_meshes",
    "get_mesh",
    "resolve_target",
]
