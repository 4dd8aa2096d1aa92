"""Auto mode, ``%monarch_auto on|off [--mesh N] [--ranks R | --slice DIM=I] [--stream S]``:
like ipyparallel's ``%autopx``, every cell runs on the mesh until it is turned off.

An IPython cleanup transformer writes a ``%%monarch ARGS`` line above each cell,
magics and ``!cmd`` included (they run on the ranks). A cell whose first line of
code (after comments) is a ``%monarch...`` magic (``%monarch_auto off``,
``%monarch_mesh --restart``, ``%monarch_debug``) or already a ``%%monarch`` cell is
left to the kernel, so
``%monarch_auto off`` always reaches it, whatever became of the mesh.
"""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class

from .args import HelpShown, cell_parser, parse_ranks


class AutoTransformer:
    """The cleanup transformer of one shell in auto mode; ``args``: the header's."""

    # IPython's check_complete (a console's Enter) skips it: it judges the cell as typed
    has_side_effects = True

    def __init__(self, args: str):
        self.args = args

    def __call__(self, lines: list[str]) -> list[str]:
        if not lines or stays_in_kernel(lines):
            return lines
        return [f"%%monarch {self.args}".rstrip() + "\n", *lines]


def stays_in_kernel(lines: list[str]) -> bool:
    """Is the cell's first line of code (after comments) a ``%monarch...`` magic, or
    the cell a ``%%monarch`` cell?"""
    first = next((s for s in (ln.strip() for ln in lines) if s and s[0] != "#"), "")
    return lines[0].startswith("%%monarch") or first.startswith("%monarch")


def line_of(shell) -> str | None:
    """The ``%%monarch`` arguments auto mode gives each cell of ``shell`` (None: off)."""
    for t in getattr(shell, "input_transformers_cleanup", ()):
        if isinstance(t, AutoTransformer):
            return t.args
    return None


def turn_on(shell, args: str) -> None:
    """Run every later cell as ``%%monarch args`` (before the awaited-cell rewrite)."""
    turn_off(shell)
    cleanup = shell.input_transformers_cleanup
    from .waiting import Transformer

    at = next((i for i, t in enumerate(cleanup) if isinstance(t, Transformer)), len(cleanup))
    cleanup.insert(at, AutoTransformer(args))


def turn_off(shell) -> bool:
    """Back to kernel cells; False if auto mode was off."""
    cleanup = shell.input_transformers_cleanup
    kept = [t for t in cleanup if not isinstance(t, AutoTransformer)]
    was_on = len(kept) != len(cleanup)
    cleanup[:] = kept
    return was_on


@magics_class
class AutoMagics(Magics):
    """``%monarch_auto``; ``mesh_of(name, what)`` finds a mesh or raises UsageError."""

    def __init__(self, shell, mesh_of):
        super().__init__(shell)
        self._mesh_of = mesh_of

    @line_magic
    def monarch_auto(self, line: str = ""):
        """%monarch_auto on [--mesh NAME] [--ranks R[,R...] | --slice DIM=I] [--stream NAME]
        %monarch_auto off
        %monarch_auto

        on: every later cell runs on the mesh's ranks, as a %%monarch cell with these
        arguments (magics and !cmd included), until %monarch_auto off. A cell whose
        first line is a %monarch... magic runs in the kernel. Without a word: say
        whether auto mode is on."""
        word, _, rest = line.strip().partition(" ")
        rest = rest.strip()
        if word == "off":
            if rest:
                raise UsageError(f"%monarch_auto off takes no arguments, got {rest!r}")
            print("auto mode off" if turn_off(self.shell) else "auto mode was off")
            return None
        if word == "":
            args = line_of(self.shell)
            print("auto mode off" if args is None else f"auto mode on: %%monarch {args}".rstrip())
            return None
        if word != "on":
            raise UsageError(
                f"%monarch_auto: expected on or off, got {word!r}\n"
                "usage: %monarch_auto on [--mesh NAME] [--ranks R | --slice DIM=I] "
                "[--stream NAME] | off"
            )
        try:
            a = cell_parser().parse_line(rest)
        except HelpShown:
            return None
        if a.noblock or a.output is not None:
            raise UsageError(
                "%monarch_auto on: --noblock and -o are options of one cell: "
                "give them to a %%monarch cell of its own"
            )
        mesh = self._mesh_of(a.mesh, "%monarch_auto on")
        outside = [r for r in parse_ranks(a.ranks) if r not in mesh.ranks] if a.ranks else []
        if outside:
            raise UsageError(
                f"%monarch_auto on: --ranks {a.ranks!r}: rank {outside[0]} is not in mesh "
                f"{mesh.name!r} (ranks {mesh.ranks})"
            )
        turn_on(self.shell, rest)
        where = "" if a.ranks is None and not a.slice else f" ({rest})"
        print(f"auto mode on: every cell runs on mesh {mesh.name!r}{where} until %monarch_auto off")
        return None
