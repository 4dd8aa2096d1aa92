"""IPython's own shell on a worker: what makes a ``%%monarch`` cell a real IPython cell.

One ``WorkerShell`` per worker process, made by the first cell (``shell()``), whose
``user_ns`` is the worker's namespace: ``get_ipython()`` returns it, and the code
that IPython's input transformers write (``get_ipython().run_line_magic(...)``,
``.system(...)``, ``.getoutput(...)``) runs magics, ``!cmd`` and ``obj?`` through it.
A cell that is plain Python is never transformed (``to_python`` is only the
fallback of a SyntaxError), so its cost is unchanged.

The worker has no terminal and no kernel: controller magics (``%monarch_*``,
``%%monarch``) and those that need a terminal or a kernel are refused by name.
Help pages (``obj?``) are printed as the rank's output; ``display()`` publishes
through ``ipython_display.WorkerDisplayPublisher``.

IPython is imported by this module and ipython_display only, which a worker loads
when its first cell runs (the host agent preloads them before it forks).
"""

from __future__ import annotations

import re
import threading

# what the shell's constructor imports, loaded with this module: the host agent's
# preload covers them, and a rank's first cell only builds the shell (~10 ms, not ~25)
import IPython.core.application  # noqa: F401
import IPython.core.completer  # noqa: F401
import IPython.core.completerlib  # noqa: F401
import IPython.core.magics  # noqa: F401
import IPython.core.oinspect  # noqa: F401
from IPython.core.error import UsageError
from IPython.core.inputtransformer2 import TransformerManager
from IPython.core.interactiveshell import ExecutionInfo, ExecutionResult, InteractiveShell
from traitlets.config import Config

try:  # a rank's cell is a notebook cell: libraries that choose their notebook form by
    # ipykernel's shell being imported (tqdm.auto's widget bar) choose it here too
    import ipykernel.zmqshell  # noqa: F401 - imported before widget_comm installs its comms
except ImportError:
    pass

from . import widget_comm
from .ipython_display import WorkerDisplayPublisher, register_formatters

# magics that need what a worker has not: the reason, said in the error
NEEDS_KERNEL = "it needs the Jupyter kernel, which a worker is not"
NEEDS_TERMINAL = "it needs a terminal, and a worker has none"
NO_GUI = "a worker runs no GUI event loop (its figures come inline, with the cell)"
REFUSED = {
    "qtconsole": NEEDS_KERNEL,
    "connect_info": NEEDS_KERNEL,
    "autosave": NEEDS_KERNEL,
    "edit": NEEDS_TERMINAL + " (it opens an editor)",
    "paste": NEEDS_TERMINAL,
    "cpaste": NEEDS_TERMINAL,
    "clear": NEEDS_TERMINAL,
    "gui": NO_GUI,
    "debug": "a worker has no stdin for pdb: use breakpoint() in the cell, "
    "or %monarch_debug --post-mortem in a notebook cell",
}
_ANSI = re.compile(r"\x1b\[[0-9;]*m")

_transformer: TransformerManager | None = None
_shell: WorkerShell | None = None
_lock = threading.Lock()


def _refuse(name: str, why: str):
    def refused(*_args, **_kwargs):
        raise UsageError(f"%{name} cannot run in a %%monarch cell: {why}")

    return refused


class WorkerShell(InteractiveShell):
    """An InteractiveShell for a worker: no terminal, no kernel, no history file, and
    the process's ``sys.modules`` and ``sys.path`` left as the worker set them."""

    def init_virtualenv(self):
        pass  # the worker's sys.path is the controller's: never adjusted for a venv

    def init_sys_modules(self):
        pass  # __main__ stays the worker's own module

    def init_prompts(self):
        pass  # no sys.ps1 = "In : ": pdb's `interact` on a worker keeps Python's ">>> "

    def init_display_pub(self):
        self.display_pub = WorkerDisplayPublisher(shell=self, parent=self)
        self.configurables.append(self.display_pub)

    def enable_matplotlib(self, gui=None):
        """``%matplotlib`` and ``%matplotlib inline`` (figures come home with the cell);
        a GUI or widget backend is refused before matplotlib switches to it."""
        if gui not in (None, "inline"):
            raise UsageError(f"%matplotlib {gui} cannot run in a %%monarch cell: {NO_GUI}")
        return super().enable_matplotlib(gui)

    def enable_gui(self, gui=None):
        if gui not in (None, "inline"):
            raise UsageError(f"%gui {gui} cannot run in a %%monarch cell: {NO_GUI}")

    def _find_with_lazy_load(self, /, type_, magic_name: str):
        if magic_name.startswith("monarch"):
            why = "it is a controller magic: run it in a notebook cell of its own"
            return _refuse(magic_name, why)
        if magic_name in REFUSED:
            return _refuse(magic_name, REFUSED[magic_name])
        return super()._find_with_lazy_load(type_, magic_name)


def _show_page(_shell, data, start: int = 0, screen_lines: int = 0) -> None:
    """The pager of ``obj?`` and ``%magic``: the page is the rank's output."""
    text = data.get("text/plain", "") if isinstance(data, dict) else str(data)
    text = "\n".join(_ANSI.sub("", text).split("\n")[start:])
    print(text)


def shell(namespace: dict) -> WorkerShell:
    """The worker's shell over ``namespace`` (made by the first call, in any thread)."""
    if _shell is not None:
        return _shell
    return _make(namespace)


def _make(namespace: dict) -> WorkerShell:
    global _shell
    with _lock:
        if _shell is None:
            config = Config()
            config.HistoryManager.enabled = False  # no sqlite file, no saving thread
            # Tab on a rank (shell_handlers.py) reads the live objects, as IPython's
            # own matchers do; Jedi's first answer takes seconds (it parses the stdlib)
            config.IPCompleter.use_jedi = False
            sh = WorkerShell.instance(user_ns=namespace, config=config, colors="nocolor")
            # IPython's exit/quit only flag a terminal loop; open refuses fds 0-2:
            # a worker cell keeps Python's own, as before
            for name in ("exit", "quit", "open"):
                namespace.pop(name, None)
                sh.user_ns_hidden.pop(name, None)
            sh.set_hook("show_in_pager", _show_page)
            register_formatters(sh.display_formatter)
            widget_comm.install()  # ipywidgets made by the cells reach the notebook
            _shell = sh
    return _shell


def to_python(source: str) -> str:
    """``source`` through IPython's input transformers, its line numbers kept: its
    leading comment and blank lines (``%%monarch``'s header line) stay as they are,
    so that a cell magic on the line after them is one."""
    global _transformer
    if _transformer is None:
        _transformer = TransformerManager()
    lines = source.splitlines(keepends=True)
    n = 0
    while n < len(lines) and (not lines[n].strip() or lines[n].lstrip().startswith("#")):
        n += 1
    head, body = "".join(lines[:n]), "".join(lines[n:])
    if head and not head.endswith("\n"):
        head += "\n"
    return (head + _transformer.transform_cell(body)) if body else source


def before_cell(sh: WorkerShell, source: str) -> ExecutionInfo:
    """IPython's events before a cell (autoreload and other extensions listen)."""
    info = ExecutionInfo(source, False, False, True, None)
    sh.events.trigger("pre_execute")
    sh.events.trigger("pre_run_cell", info)
    return info


def after_cell(sh: WorkerShell, info: ExecutionInfo, value, error) -> None:
    """IPython's events after a cell."""
    result = ExecutionResult(info)
    result.result = value
    result.error_in_exec = error
    sh.events.trigger("post_execute")
    sh.events.trigger("post_run_cell", result)


__all__ = ["REFUSED", "WorkerShell", "after_cell", "before_cell", "shell", "to_python"]
