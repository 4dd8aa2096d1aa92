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


def run_source(source: str, filename: str, namespace: dict):
    """Execute ``source``; return the value of its last statement when that is an
    expression (as IPython does), else None."""
    register_source(filename, source)
    tree = ast.parse(source, filename, "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    if tree.body:
        exec(compile(tree, filename, "exec"), namespace)
    if last is not None:
        return eval(compile(last, filename, "eval"), namespace)
    return _NO_VALUE
