"""Structured answers about a paused pdb session: frames, scopes, variables, evaluate.

The kernel's DAP adapter (notebook/dap.py) asks these through DebuggerMessage
actions ``("dap", rid, command, args)``; they run on the paused stream's own
thread (which owns the frames). Every reply is bounded: values are summaries
(tensors as shape/dtype/device, long reprs cut), children come in pages, and
what can be expanded is kept worker side under a small integer reference for
as long as the pause lasts.
"""

from __future__ import annotations

import itertools
import linecache
import reprlib

MAX_VALUE = 300  # characters of one value's summary
MAX_CHILDREN = 500  # children in one variables reply, whatever was asked
_SCALARS = (str, bytes, int, float, complex, bool, type(None))

_repr = reprlib.Repr()
_repr.maxstring = MAX_VALUE
_repr.maxother = MAX_VALUE
_repr.maxlist = _repr.maxtuple = _repr.maxset = _repr.maxdict = 20
_repr.maxlevel = 3


def is_tensor(v) -> bool:
    return (
        type(v).__module__.startswith("torch")
        and hasattr(v, "shape")
        and hasattr(v, "dtype")
        and hasattr(v, "device")
    )


def summary(v) -> str:
    """A short, bounded text for ``v``: never the whole of a huge value."""
    if is_tensor(v):
        return f"tensor(shape={tuple(v.shape)}, dtype={v.dtype}, device={v.device})"
    try:
        text = _repr.repr(v)
    except Exception as e:  # a broken __repr__ must not break the panel
        text = f"<repr failed: {type(e).__name__}: {e}>"
    if isinstance(v, (list, tuple, dict, set, frozenset)) and len(v) > 20:
        text = f"{type(v).__name__}(len={len(v)}) {text}"
    return text if len(text) <= MAX_VALUE else text[: MAX_VALUE - 3] + "..."


def _children(v):
    """(name, value) pairs of ``v``'s children, lazily; None: nothing to expand."""
    if isinstance(v, _SCALARS):
        return None
    if is_tensor(v):
        meta = {"shape": tuple(v.shape), "dtype": v.dtype, "device": v.device}
        for name in ("requires_grad", "is_leaf"):
            meta[name] = getattr(v, name, None)
        return iter(meta.items())
    if isinstance(v, dict):
        return ((repr(k) if not isinstance(k, str) else k, x) for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return ((str(i), x) for i, x in enumerate(v))
    if isinstance(v, (set, frozenset)):
        return ((str(i), x) for i, x in enumerate(v))
    d = getattr(v, "__dict__", None)
    if isinstance(d, dict) and d:
        return iter(d.items())
    return None


def _expandable(v) -> bool:
    if isinstance(v, _SCALARS):
        return False
    if is_tensor(v) or isinstance(v, (dict, list, tuple, set, frozenset)):
        return True
    d = getattr(v, "__dict__", None)
    return isinstance(d, dict) and bool(d)


def _hidden(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


class Inspector:
    """The answers for one pause of one RemotePdb; ``reset`` when it runs on."""

    def __init__(self, pdb):
        self.pdb = pdb
        self._refs: list = []  # ref n (1-based) -> the object whose children it names

    def reset(self) -> None:
        self._refs.clear()

    def ref(self, v) -> int:
        self._refs.append(v)
        return len(self._refs)

    def variable(self, name: str, v) -> dict:
        return {
            "name": name,
            "value": summary(v),
            "type": type(v).__name__,
            "variablesReference": self.ref(v) if _expandable(v) else 0,
        }

    def _frame(self, index: int):
        stack = self.pdb.stack
        if not 0 <= index < len(stack):
            raise LookupError(f"no frame {index} (the stack has {len(stack)})")
        frame = stack[index][0]
        if index == self.pdb.curindex:
            return frame, self.pdb.curframe_locals
        return frame, frame.f_locals

    # ------------------------------------------------------------ the commands

    def stack(self, args: dict) -> dict:
        """Frames innermost first: index (into pdb's stack), name, file, line."""
        frames = [
            {"index": i, "name": f.f_code.co_name, "file": f.f_code.co_filename, "line": line}
            for i, (f, line) in enumerate(self.pdb.stack)
        ]
        frames.reverse()
        return {"frames": frames, "current": self.pdb.curindex}

    def scopes(self, args: dict) -> dict:
        frame, local = self._frame(int(args["frame"]))
        glob = {k: v for k, v in frame.f_globals.items() if not _hidden(k)}
        return {
            "scopes": [
                {"name": "Locals", "variablesReference": self.ref(dict(local))},
                {"name": "Globals", "variablesReference": self.ref(glob)},
            ]
        }

    def variables(self, args: dict) -> dict:
        ref = int(args["ref"])
        if not 1 <= ref <= len(self._refs):
            raise LookupError(f"no variable reference {ref} in this pause")
        kids = _children(self._refs[ref - 1]) or iter(())
        start = max(0, int(args.get("start") or 0))
        count = int(args.get("count") or MAX_CHILDREN)
        count = max(0, min(count, MAX_CHILDREN))
        return {
            "variables": [
                self.variable(n, v) for n, v in itertools.islice(kids, start, start + count)
            ]
        }

    def evaluate(self, args: dict) -> dict:
        frame, local = self._frame(int(args["frame"]))
        expr = str(args["expression"])
        try:
            code = compile(expr, "<debug console>", "eval")
        except SyntaxError:
            exec(compile(expr, "<debug console>", "exec"), frame.f_globals, local)
            return {"result": "", "type": "", "variablesReference": 0}
        v = eval(code, frame.f_globals, local)
        var = self.variable(expr, v)
        return {
            "result": var["value"],
            "type": var["type"],
            "variablesReference": var["variablesReference"],
        }

    def source(self, args: dict) -> dict:
        """The text of a file as this worker knows it (its linecache: cells, files)."""
        path = str(args["path"])
        lines = linecache.getlines(path)
        if not lines:
            raise LookupError(f"source of {path} is not available on rank {self.pdb.rank} either")
        return {"content": "".join(lines)}

    def answer(self, command: str, args: dict) -> tuple[bool, object]:
        """(True, body) or (False, why): never raises."""
        fn = {
            "stack": self.stack,
            "scopes": self.scopes,
            "variables": self.variables,
            "evaluate": self.evaluate,
            "source": self.source,
        }.get(command)
        if fn is None:
            return False, f"unknown debugger request {command!r}"
        try:
            return True, fn(args or {})
        except Exception as e:
            return False, f"{type(e).__name__}: {e}"
