"""Running cell source in a worker's persistent namespace."""

from __future__ import annotations

import ast
import linecache

_NO_VALUE = None


def register_source(filename: str, source: str) -> None:
    """Make tracebacks, pdb and inspect show the real lines of ``source``."""
    lines = source.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    linecache.cache[filename] = (len(source), None, lines, filename)


def run_source(source: str, filename: str, namespace: dict, to_python=None):
    """Execute ``source``; return the value of its last statement when that is an
    expression (as IPython does), else None. Source that is not Python is turned
    into Python by ``to_python`` (IPython's transformers), when given; tracebacks
    show the source's own lines either way."""
    register_source(filename, source)
    try:
        tree = ast.parse(source, filename, "exec")
    except SyntaxError:
        if to_python is None:
            raise
        tree = ast.parse(to_python(source), filename, "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    if tree.body:
        exec(compile(tree, filename, "exec"), namespace)
    if last is not None:
        return eval(compile(last, filename, "eval"), namespace)
    return _NO_VALUE
