"""Argument parsing of the magics: argparse parsers that raise UsageError, and
the small grammars of their values (``dp=2``, ``--ranks 0,2-3``, ``--slice dp=0``)."""

from __future__ import annotations

import argparse
import functools
import shlex

from IPython.core.error import UsageError

RESERVED = ("name", "backend", "interface")
BACKENDS = ("gloo", "nccl", "mpi", "ucc")


class HelpShown(Exception):
    """``-h``: the help text was printed; the magic does nothing else."""


class Parser(argparse.ArgumentParser):
    """argparse, except that a bad argument raises UsageError (its message names
    the argument) instead of exiting the kernel."""

    def __init__(self, prog: str, description: str):
        super().__init__(prog=prog, description=description, add_help=True, allow_abbrev=False)

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message}\nusage: {self.format_usage()[7:].strip()}")

    def exit(self, status: int = 0, message: str | None = None):
        if message:
            print(message)
        raise HelpShown()

    def parse_line(self, line: str) -> argparse.Namespace:
        try:
            argv = shlex.split(line)
        except ValueError as e:
            raise UsageError(f"{self.prog}: cannot split the arguments: {e}") from None
        if self.usage is None:
            # argparse %-formats usage text; the magics' names start with '%'
            self.usage = self.format_usage()[7:].strip().replace("%", "%%")
        return self.parse_intermixed_args(argv)


@functools.cache
def mesh_parser() -> Parser:
    p = Parser(
        "%monarch_mesh",
        "Create a local mesh (it becomes the active one), or show, restart or shut one down.",
    )
    p.add_argument(
        "dims",
        nargs="*",
        metavar="DIM=SIZE",
        help="named dims of a new mesh, in order, e.g. dp=2 or hosts=1 gpus=2",
    )
    p.add_argument(
        "--name",
        help="the mesh's name (default: 'default'); creating a mesh whose name exists "
        "replaces that mesh",
    )
    p.add_argument("--backend", choices=BACKENDS, help="collectives backend (default: gloo on CPU)")
    p.add_argument(
        "--keep-alive",
        metavar="DURATION",
        help="a new local mesh outlives this kernel (its death or restart) by DURATION, "
        "e.g. 30m or 3s (monarch-nb list, monarch-nb kill NAME)",
    )
    p.add_argument(
        "--connect",
        action="store_true",
        help="wait for workers started by another launcher (torchrun, srun) instead of spawning",
    )
    p.add_argument(
        "--slurm",
        action="store_true",
        help="host agents as a Slurm job (sbatch, or srun in an allocation): "
        "nodes=4 ranks_per_node=2 [gpus=G partition=P time=T account=A]",
    )
    p.add_argument("--world", type=int, help="with --connect: how many workers join")
    p.add_argument("--connection-file", help="with --connect: where to write the connection file")
    p.add_argument(
        "--interface",
        default="127.0.0.1",
        help="with --connect: the address to bind (0.0.0.0 or an address for other hosts)",
    )
    p.add_argument(
        "--advertise",
        help="with --connect or --slurm: the address written for the workers "
        "(default: this host's name)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="with --connect: seconds to wait")
    p.add_argument(
        "--dashboard",
        choices=("cell", "side", "none"),
        default="cell",
        help="where the mesh's dashboard shows: under the cell (default), docked in "
        "JupyterLab's side area (the sidecar package), or nowhere (a status line)",
    )
    p.add_argument(
        "--autoreload",
        action="store_true",
        help="reload your changed modules on every rank before each command "
        "(IPython's %%autoreload 2 on the ranks; again after a --restart)",
    )
    p.add_argument(
        "--restore",
        metavar="PATH",
        help="with --restart: load the checkpoint at PATH (mesh.save) into the fresh workers",
    )
    p.add_argument(
        "--steal",
        action="store_true",
        help="with --attach: take the mesh from the kernel that drives it (that one lets go)",
    )
    action = p.add_mutually_exclusive_group()
    action.add_argument(
        "--attach",
        metavar="NAME",
        nargs="?",
        const="",
        help="drive the kept-alive mesh NAME (monarch-nb list; without NAME: the only "
        "live one) from this kernel: its workers' namespaces, streams and pending output",
    )
    action.add_argument(
        "--restart", action="store_true", help="fresh workers for the mesh (--name or active)"
    )
    action.add_argument(
        "--shutdown", action="store_true", help="stop the mesh's workers (--name or active)"
    )
    return p


@functools.cache
def cell_parser() -> Parser:
    p = Parser("%%monarch", "Run the cell on every rank (or some ranks) of a mesh.")
    p.add_argument("--mesh", metavar="NAME", help="the mesh to run on (default: the active one)")
    target = p.add_mutually_exclusive_group()
    target.add_argument("--ranks", metavar="R[,R...]", help="only these ranks, e.g. 0,2 or 0-3")
    target.add_argument(
        "--slice",
        action="append",
        metavar="DIM=I",
        help="only the ranks of a slice, e.g. dp=0 or dp=0:2 (repeat or comma-separate dims)",
    )
    p.add_argument("--stream", metavar="NAME", help="the workers' stream (queue) to run on")
    p.add_argument(
        "--noblock",
        action="store_true",
        help="return at once; output and results still land under this cell",
    )
    p.add_argument(
        "-o",
        "--output",
        metavar="NAME",
        help="bind the cell's AsyncResult to NAME in the notebook (per-rank values, "
        "done(), cancel(), await)",
    )
    p.add_argument(
        "--push",
        metavar="NAME[,NAME...]",
        help="also send these notebook variables to the workers before the cell runs",
    )
    p.add_argument(
        "--profile",
        nargs="?",
        const="",
        metavar="DIR",
        help="run torch.profiler on every rank of the mesh for this cell: one merged trace "
        "in DIR (default monarch-profiles/cellN) and a summary under the cell",
    )
    return p


def parse_dims(tokens: list[str]) -> dict:
    """``["dp=2", "tp=4"]`` -> ``{"dp": 2, "tp": 4}``; UsageError naming a bad token."""
    dims: dict = {}
    for tok in tokens:
        name, eq, size = tok.partition("=")
        if not eq:
            raise UsageError(
                f"%monarch_mesh: unexpected argument {tok!r}: dims are written NAME=SIZE, e.g. dp=2"
            )
        if not name.isidentifier():
            raise UsageError(f"%monarch_mesh: dim name {name!r} (in {tok!r}) is not an identifier")
        if name in RESERVED:
            raise UsageError(
                f"%monarch_mesh: {name!r} (in {tok!r}) is not a dim name: use --{name} instead"
            )
        if name in dims:
            raise UsageError(f"%monarch_mesh: dim {name!r} is given twice")
        try:
            n = int(size)
        except ValueError:
            n = 0
        if n < 1 or not size.strip().isdigit():
            raise UsageError(
                f"%monarch_mesh: the size of dim {name!r} must be a positive integer, got {size!r}"
            )
        dims[name] = n
    return dims


def parse_ranks(spec: str) -> list[int]:
    """``"0,2"`` -> ``[0, 2]``; ``"0-3,6"`` -> ``[0, 1, 2, 3, 6]``."""
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        lo, dash, hi = part.partition("-")
        try:
            if dash:
                a, b = int(lo), int(hi)
                if a > b:
                    raise ValueError
                out.extend(range(a, b + 1))
            else:
                out.append(int(part))
        except ValueError:
            raise UsageError(
                f"%%monarch: --ranks {spec!r}: {part!r} is not a rank or a range like 0-3"
            ) from None
    if any(r < 0 for r in out):
        raise UsageError(f"%%monarch: --ranks {spec!r}: ranks are non-negative")
    return list(dict.fromkeys(out))


def parse_slice(specs: list[str]) -> dict:
    """``["dp=0", "tp=1:3"]`` (or ``["dp=0,tp=1:3"]``) -> ``{"dp": 0, "tp": slice(1, 3)}``."""
    out: dict = {}
    for spec in specs:
        for part in spec.split(","):
            part = part.strip()
            name, eq, sel = part.partition("=")
            if not eq or not name.isidentifier():
                raise UsageError(
                    f"%%monarch: --slice {spec!r}: {part!r} is not DIM=INDEX or DIM=START:STOP"
                )
            try:
                if ":" in sel:
                    bits = [int(b) if b.strip() else None for b in sel.split(":")]
                    if len(bits) > 3:
                        raise ValueError
                    out[name] = slice(*bits)
                else:
                    out[name] = int(sel)
            except ValueError:
                raise UsageError(
                    f"%%monarch: --slice {spec!r}: the index of dim {name!r} must be an integer "
                    f"or START:STOP[:STEP], got {sel!r}"
                ) from None
    return out


def parse_names(spec: str) -> list[str]:
    names = [n.strip() for n in spec.split(",") if n.strip()]
    for n in names:
        if not n.isidentifier():
            raise UsageError(f"%%monarch: --push {spec!r}: {n!r} is not a variable name")
    if not names:
        raise UsageError("%%monarch: --push needs variable names, e.g. --push lr,data")
    return names


DEBUG_USAGE = (
    "usage: %monarch_debug [--mesh NAME] [list | attach R | cast RANKS CMD | continue | help]\n"
    "       %monarch_debug [--mesh NAME] [--stream NAME] --post-mortem [RANK]"
)
DEBUG_COMMANDS = ("list", "attach", "cast", "continue", "help")


def parse_debug(line: str) -> tuple[str | None, str | None, object, str]:
    """``%monarch_debug`` options, then the command words (kept whole: a pdb
    command may look like an option). Returns (mesh, stream, post_mortem, words);
    post_mortem is None, "last" or a rank."""
    words = line.split()
    mesh = stream = post = None
    while words and words[0].startswith("--"):
        opt = words.pop(0)
        if opt in ("--mesh", "--stream"):
            if not words:
                raise UsageError(f"%monarch_debug: {opt} needs a name\n{DEBUG_USAGE}")
            if opt == "--mesh":
                mesh = words.pop(0)
            else:
                stream = words.pop(0)
        elif opt == "--post-mortem":
            post = "last"
            if words and words[0].lstrip("-").isdigit():
                post = int(words.pop(0))
        else:
            raise UsageError(f"%monarch_debug: unknown option {opt!r}\n{DEBUG_USAGE}")
    rest = " ".join(words)
    if post is not None and rest:
        raise UsageError(f"%monarch_debug: --post-mortem takes only a rank, got {rest!r}")
    if rest and rest.split()[0] not in DEBUG_COMMANDS:
        raise UsageError(f"%monarch_debug: unknown command {rest.split()[0]!r}\n{DEBUG_USAGE}")
    return mesh, stream, post, rest
