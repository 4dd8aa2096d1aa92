"""Traceback text as the user wants to read it: their own frames only (not
monarch_nb's, concurrent.futures' or IPython's), each file under the name the
front end gives it (a notebook layer installs ``Cell In[n]`` for kernel cells)."""

from __future__ import annotations

import concurrent.futures
import os
import re
import sys
import traceback
from collections.abc import Callable

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_FUTURES = os.path.dirname(os.path.abspath(concurrent.futures.__file__))
_FILE_LINE = re.compile(r'^(\s*)File "([^"]*)", line (\d+)(.*)$')

_labeler: Callable[[str], str | None] | None = None


def set_file_labeler(fn: Callable[[str], str | None] | None) -> None:
    """Install ``fn(filename) -> label or None`` (e.g. ``"Cell In[3]"``), used for
    the local and remote frames of rendered errors; None removes it."""
    global _labeler
    _labeler = fn


def _label(filename: str) -> str | None:
    if _labeler is None:
        return None
    try:
        return _labeler(filename)
    except Exception:  # a broken labeler must not hide the error it renders
        return None


def _hidden_dirs() -> list[str]:
    dirs = [_PACKAGE, _FUTURES]
    ipython = sys.modules.get("IPython")  # its frames run the cell; never imported here
    if ipython is not None and getattr(ipython, "__file__", None):
        dirs.append(os.path.dirname(os.path.abspath(ipython.__file__)))
    return dirs


def is_internal(filename: str) -> bool:
    f = os.path.abspath(filename) if filename and not filename.startswith("<") else filename
    return any(f.startswith(d + os.sep) for d in _hidden_dirs())


def user_place(skip: tuple = ()) -> str:
    """``file:line in function`` of the innermost frame of the running stack that is the
    user's (not internal, nor under a directory of ``skip``), its file under its front-end
    name: where the program did what a message is about."""
    for f in reversed(traceback.extract_stack()):
        if not is_internal(f.filename) and not f.filename.startswith(skip):
            return f"{_label(f.filename) or os.path.basename(f.filename)}:{f.lineno} in {f.name}"
    return "an unknown place"


def user_frames(tb) -> list[str]:
    """The frames of local traceback ``tb`` that are the user's, formatted."""
    try:
        frames = [f for f in traceback.extract_tb(tb) if not is_internal(f.filename)]
    except Exception:
        return []
    lines = []
    for f in frames:
        label = _label(f.filename)
        where = label or f'File "{f.filename}"'
        lines.append(f"  {where}, line {f.lineno}, in {f.name}")
        if f.line:
            lines.append(f"    {f.line.strip()}")
    return lines


def relabel(text: str) -> str:
    """Remote traceback ``text`` with its files under their front-end names."""
    if _labeler is None:
        return text
    out = []
    for line in text.split("\n"):
        m = _FILE_LINE.match(line)
        label = _label(m.group(2)) if m else None
        out.append(f"{m.group(1)}{label}, line {m.group(3)}{m.group(4)}" if label else line)
    return "\n".join(out)
