"""The magics: ``%monarch_mesh`` and ``%%monarch``."""

from __future__ import annotations

import os
from contextlib import ExitStack, contextmanager

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from ..api import launch
from ..api import mesh as mesh_mod
from . import cell_syntax, waiting
from .args import (
    HelpShown,
    cell_parser,
    mesh_parser,
    parse_debug,
    parse_dims,
    parse_names,
    parse_ranks,
)
from .args import parse_slice as parse_slice_spec
from .cell import CellRun
from .mesh_views import MeshViews
from .output import OutputHub
from .pdb_prompt import HELP, NoStdin, Prompt, describe
from .publish import Publisher
from .push import names_to_push

DEFAULT_NAME = "default"


@contextmanager
def _closing_on_error(stack: ExitStack):
    """A cell that fails to send ends what started with it (its profile) at once."""
    try:
        yield
    except BaseException as e:
        stack.__exit__(type(e), e, e.__traceback__)
        raise


@magics_class
class MonarchMagics(Magics):
    def __init__(self, shell):
        super().__init__(shell)
        self.publisher = Publisher(shell)
        self.hub = OutputHub(self.publisher)
        self.views = MeshViews(
            self.publisher.in_kernel,
            on_restart=lambda mesh: self.hub.router(mesh),
            on_shutdown=lambda mesh: self.hub.forget(mesh),
        )
        self._filenames: dict[str, int] = {}
        self.lab = None  # the JupyterLab extension's LabChannel (in a kernel)

    def close(self) -> None:
        if self.lab is not None:
            self.lab.close()
        self.views.close()
        self.hub.close()

    # ------------------------------------------------------------ meshes

    def _mesh(self, name: str | None, what: str):
        if name is not None:
            try:
                return mesh_mod.get_mesh(name)
            except KeyError:
                known = sorted(mesh_mod.all_meshes())
                raise UsageError(
                    f"{what}: no mesh named {name!r} (meshes: {', '.join(known) or 'none'})"
                ) from None
        try:
            return mesh_mod.get_mesh()
        except RuntimeError:
            raise UsageError(
                f"{what}: no active mesh: create one with %monarch_mesh dp=2"
            ) from None

    @line_magic
    def monarch_mesh(self, line: str = ""):
        try:
            a = mesh_parser().parse_line(line)
        except HelpShown:
            return None
        if a.restore is not None and not a.restart:
            raise UsageError("%monarch_mesh: --restore PATH goes with --restart")
        if a.keep_alive is not None and (a.slurm or a.restart or a.shutdown):
            raise UsageError("%monarch_mesh: --keep-alive is for a new mesh (dims, or --connect)")
        if a.steal and a.attach is None:
            raise UsageError("%monarch_mesh: --steal goes with --attach NAME")
        if a.attach is not None:
            return self._attach(a)
        if a.restart or a.shutdown:
            flag = "--restart" if a.restart else "--shutdown"
            if a.dims or a.backend:
                bad = a.dims[0] if a.dims else "--backend"
                raise UsageError(
                    f"%monarch_mesh: {flag} takes no dims or --backend (got {bad!r}); "
                    f"name the mesh with --name"
                )
            mesh = self._mesh(a.name, f"%monarch_mesh {flag}")
            if a.shutdown:
                self._shutdown(mesh)
                print(f"mesh {mesh.name!r} shut down")
                return None
            mesh.restart(restore=a.restore)
            return self._started(mesh, a)
        if a.connect:
            return self._connect(a)
        if a.slurm:
            return self._slurm(a)
        if not a.dims:
            if a.backend:
                raise UsageError(
                    "%monarch_mesh: --backend needs the dims of a new mesh, "
                    "e.g. %monarch_mesh dp=2 --backend gloo"
                )
            mesh = self._mesh(a.name, "%monarch_mesh")
            if a.autoreload:
                mesh.autoreload()
            self.views.show(mesh, a.dashboard)
            return None
        if a.world is not None or a.connection_file is not None:
            raise UsageError("%monarch_mesh: --world and --connection-file go with --connect")
        dims = parse_dims(a.dims)
        name = a.name if a.name is not None else DEFAULT_NAME
        if not name.strip():
            raise UsageError("%monarch_mesh: --name must not be empty")
        old = mesh_mod.all_meshes().get(name)
        if old is not None:
            self._shutdown(old)
        try:
            mesh = launch.local_mesh(
                name=name, backend=a.backend, keep_alive=a.keep_alive, **dims
            )
        except ValueError as e:
            raise UsageError(f"%monarch_mesh: {e}") from None
        return self._started(mesh, a)

    def _attach(self, a):
        """``--attach NAME [--steal]``: a kept-alive mesh, driven from this kernel now."""
        if a.dims or a.backend or a.keep_alive is not None or a.connect or a.slurm:
            raise UsageError("%monarch_mesh --attach NAME takes only --steal and --dashboard")
        try:
            mesh = launch.attach(a.attach or None, steal=a.steal)
        except (ValueError, LookupError, RuntimeError) as e:
            raise UsageError(f"%monarch_mesh --attach: {e}") from None
        print(f"attached to mesh {mesh.name!r}: {mesh.size} ranks, streams {sorted(mesh.streams)}")
        return self._started(mesh, a)

    def _started(self, mesh, a) -> None:
        """A new (or restarted) mesh: its output routed here, ``--autoreload`` on, shown."""
        self.hub.router(mesh)
        if a.autoreload:
            mesh.autoreload()
        self.views.show(mesh, a.dashboard)

    def _connect(self, a):
        """``--connect --world N dp=...``: wait for workers another launcher starts."""
        if a.world is None:
            raise UsageError("%monarch_mesh --connect: --world N says how many workers join")
        dims = parse_dims(a.dims) if a.dims else {}
        name = a.name if a.name is not None else DEFAULT_NAME
        old = mesh_mod.all_meshes().get(name)
        if old is not None:
            self._shutdown(old)
        try:
            mesh = launch.connect_mesh(
                world=a.world,
                connection_file=a.connection_file,
                timeout=a.timeout,
                name=name,
                backend=a.backend,
                interface=a.interface,
                advertise=a.advertise,
                keep_alive=a.keep_alive,
                **dims,
            )
        except ValueError as e:
            raise UsageError(f"%monarch_mesh --connect: {e}") from None
        return self._started(mesh, a)

    def _slurm(self, a):
        """``--slurm nodes=4 ranks_per_node=2``: host agents as a Slurm job."""
        from .slurm_args import parse_slurm

        kw = parse_slurm(a.dims or [])
        name = a.name if a.name is not None else DEFAULT_NAME
        old = mesh_mod.all_meshes().get(name)
        if old is not None:
            self._shutdown(old)
        interface = "0.0.0.0" if a.interface == "127.0.0.1" else a.interface
        try:
            mesh = launch.slurm_mesh(name=name, backend=a.backend, interface=interface,
                                     connection_file=a.connection_file, timeout=a.timeout,
                                     advertise=a.advertise, **kw)  # fmt: skip
        except ValueError as e:
            raise UsageError(f"%monarch_mesh --slurm: {e}") from None
        return self._started(mesh, a)

    def _shutdown(self, mesh) -> None:
        mesh.shutdown()
        self.views.refresh(mesh, final=True)
        self.hub.forget(mesh)

    # ------------------------------------------------------------ cells

    def _filename(self) -> str:
        """``<monarch In[7]>``: the name tracebacks show for this cell's code."""
        count = getattr(self.shell.displayhook, "prompt_count", self.shell.execution_count)
        base = f"<monarch In[{count}]>"
        n = self._filenames.get(base, 0) + 1
        self._filenames[base] = n
        return base if n == 1 else f"{base[:-1]}#{n}>"

    @cell_magic
    def monarch(self, line: str, cell: str):
        started = self._start_cell(line, cell)
        if started is not None:
            run, profiling = started
            with profiling:
                run.wait()
        return None

    async def monarch_awaited(self, line: str, cell: str):
        """``%%monarch`` as an awaited call (``waiting.transform`` writes it): the
        kernel keeps handling widget messages while the cell waits."""
        started = self._start_cell(self.shell.var_expand(line, 1), cell)
        if started is not None:
            run, profiling = started
            with profiling:
                await waiting.wait(run)

    def _start_cell(self, line: str, cell: str) -> tuple[CellRun, ExitStack] | None:
        """Parse, check and send a cell: the run to wait for and what ends with it (a
        profile, with ``--profile``); None: nothing to wait for."""
        try:
            a = cell_parser().parse_line(line)
        except HelpShown:
            return None
        mesh = self._mesh(a.mesh, "%%monarch" + (" --mesh" if a.mesh else ""))
        CellRun.check_usable(mesh)
        ranks = mesh.ranks
        if a.ranks is not None:
            ranks = parse_ranks(a.ranks)
            outside = [r for r in ranks if r not in mesh.ranks]
            if outside:
                raise UsageError(
                    f"%%monarch: --ranks {a.ranks!r}: rank {outside[0]} is not in mesh "
                    f"{mesh.name!r} (ranks {mesh.ranks})"
                )
        elif a.slice:
            spec = parse_slice_spec(a.slice)
            try:
                ranks = mesh.slice(**spec).ranks
            except (ValueError, IndexError, TypeError) as e:
                raise UsageError(f"%%monarch: --slice {','.join(a.slice)!r}: {e}") from None
        if a.output is not None and not (a.output.isidentifier() and a.output != "_"):
            raise UsageError(f"%%monarch: -o needs a variable name, got {a.output!r}")
        if a.profile is not None and a.noblock:
            raise UsageError("%%monarch --profile waits for the cell to end: drop --noblock")
        if a.stream is not None:
            if not a.stream.strip():
                raise UsageError("%%monarch: --stream needs a name")
            stream = mesh.stream(a.stream)
        else:
            stream = mesh.default_stream
        explicit = parse_names(a.push) if a.push is not None else None
        names = names_to_push(cell, self.shell.user_ns, explicit)
        filename = self._filename()
        # line 1 stands for the magic's own line: tracebacks show the cell's real line numbers
        source = f"# %%monarch {line}".rstrip() + "\n" + cell
        cell_syntax.check(source, filename, self.shell)
        first = next((ln.strip() for ln in cell.splitlines() if ln.strip()), "")
        label = f"%%monarch {filename[9:-1]}"
        what = f"{label}: {first[:40]}"
        run = CellRun(
            self.hub,
            mesh,
            ranks,
            stream,
            source,
            filename,
            names,
            self.publisher.current_parent(),
            label,
            what,
        )
        profiling = ExitStack()
        if a.profile is not None:
            folder = a.profile or os.path.join("monarch-profiles", f"cell{self.shell.execution_count}")
            try:
                profiling.enter_context(mesh.profile(folder))
            except ValueError as e:  # an unwritable DIR, named
                raise UsageError(f"%%monarch --profile: {e}") from None
        with _closing_on_error(profiling):
            run.send(waited=not a.noblock)
        if a.output is not None:
            self.shell.user_ns[a.output] = run.future
        if a.noblock:
            run.detach()
            return None
        return run, profiling


@magics_class
class DebugMagics(Magics):
    """``%monarch_debug``: the paused remote pdb sessions of a mesh."""

    def __init__(self, shell, mesh_of):
        super().__init__(shell)
        self._mesh_of = mesh_of

    @line_magic
    def monarch_debug(self, line: str = ""):
        """%monarch_debug [list | attach R | cast RANKS CMD | continue | help]
        %monarch_debug --post-mortem [RANK]

        Without a command: list the paused sessions and serve them at the debugger
        prompt. --post-mortem opens pdb at the frame of the last remote failure
        (on RANK, default: the lowest rank of the newest error)."""
        mesh_name, stream_name, post, rest = parse_debug(line)
        mesh = self._mesh_of(mesh_name, "%monarch_debug")
        dbg = mesh.debugger
        prompt = Prompt(dbg)
        if post is not None:
            return self._post_mortem(mesh, post, stream_name, prompt)
        cmd, _, arg = rest.partition(" ")
        if cmd == "help":
            print(HELP)
        elif cmd == "list":
            print(describe(dbg.sessions()))
        elif cmd == "continue":
            n = len(dbg.sessions())
            dbg.continue_all()
            print(f"continued {n} session(s)")
        elif cmd == "cast":
            prompt._cast(arg.strip())
        elif not dbg.sessions():
            print("no paused debugger sessions")
        else:
            print(describe(dbg.sessions()))
            self._serve(
                prompt, int(arg) if cmd == "attach" and arg.strip().isdigit() else None, cmd, arg
            )
        return None

    def _serve(self, prompt: Prompt, rank, cmd: str, arg: str) -> None:
        if cmd == "attach" and rank is None:
            raise UsageError(f"%monarch_debug attach: expected a rank, got {arg!r}")
        try:
            prompt.serve(attach=rank)
        except NoStdin:
            print(
                "this front end has no stdin: drive the sessions with "
                "%monarch_debug cast RANKS CMD and %monarch_debug continue"
            )

    def _post_mortem(self, mesh, post, stream_name, prompt: Prompt):
        errors = mesh.status()["errors"]
        if post == "last":
            if not errors:
                raise UsageError("%monarch_debug --post-mortem: no remote failure to debug")
            rank = errors[0]["ranks"][0]
            stream_name = stream_name or errors[0]["stream"]
        else:
            rank = post
            if rank not in mesh.ranks:
                raise UsageError(
                    f"%monarch_debug --post-mortem: rank {rank} is not in mesh {mesh.name!r}"
                )
        stream = mesh.streams.get(stream_name or "default")
        sid = None if stream is None else stream.id
        if sid is None:
            raise UsageError(f"%monarch_debug --post-mortem: no stream {stream_name!r}")
        fut = mesh.debugger.post_mortem(rank, sid)
        while not fut.done() and not mesh.debugger.wait_any(0.2):
            pass
        try:
            prompt.serve(attach=rank)
        except NoStdin:
            mesh.debugger.continue_all()
            print("this front end has no stdin: the post-mortem session was closed")
        try:
            fut.result(timeout=30)
        except Exception as e:
            raise UsageError(f"%monarch_debug --post-mortem: {str(e).splitlines()[-1]}") from None
        return None


def _with_help(fn, parser):
    fn.__doc__ = parser().format_help()


_with_help(MonarchMagics.monarch_mesh, mesh_parser)
_with_help(MonarchMagics.monarch, cell_parser)
