"""The worker's handlers of tensor ops (DefineOp, RunOp) and recordings (a part of
Worker, which dispatches each message to the handler of its name).

A DefineOp is prepared once: its function resolved (an aten op to its
OpOverload) and its slots located, so that a RunOp costs a list of cells and
one call.
"""

from __future__ import annotations

from ..protocol import messages as m
from ..protocol.aten import OpSlot, resolve_op, run_op
from ..protocol.pickling import resolve_function
from .cell import Cell, get_value


def _has_slot(obj) -> bool:
    t = type(obj)
    if t is OpSlot:
        return True
    if t in (tuple, list):
        return any(_has_slot(o) for o in obj)
    if t is dict:
        return any(_has_slot(v) for v in obj.values())
    return False


def _fill(obj, values: list):
    t = type(obj)
    if t is OpSlot:
        return values[obj.i]
    if t is tuple:
        return tuple(_fill(o, values) for o in obj)
    if t is list:
        return [_fill(o, values) for o in obj]
    if t is dict:
        return {k: _fill(v, values) for k, v in obj.items()}
    return obj


class OpTemplate:
    """A defined op: ``run(values)`` calls it with ``values`` in its slots."""

    def __init__(self, msg: m.DefineOp):
        fn, args, kwargs = resolve_function(msg.function), tuple(msg.args), dict(msg.kwargs)
        if fn is run_op and args and type(args[0]) is str:
            fn, args = resolve_op(args[0]), args[1:]  # the op itself: no lookup per call
        self.fn, self.args, self.kwargs, self.what = fn, args, kwargs, msg.what
        self._slots = [(i, a.i) for i, a in enumerate(args) if type(a) is OpSlot]
        self._nested = _has_slot(kwargs) or any(
            type(a) is not OpSlot and _has_slot(a) for a in args
        )

    def run(self, values: list):
        if self._nested:
            return self.fn(*_fill(self.args, values), **_fill(self.kwargs, values))
        a = list(self.args)
        for i, j in self._slots:
            a[i] = values[j]
        return self.fn(*a, **self.kwargs)


class _Undefined:
    """The template of an op id this worker never heard of (a controller bug)."""

    def __init__(self, op: int, error: BaseException | None = None):
        self.what = f"op {op}"
        self.error = error or RuntimeError(f"tensor op {op} was never defined on this worker")

    def run(self, values: list):
        raise self.error


class OpHandlers:
    """Handlers of DefineOp, RunOp, DefineRecording and CallRecording."""

    def DefineOp(self, msg: m.DefineOp) -> None:
        try:
            self.ops[msg.op] = OpTemplate(msg)
        except Exception as e:  # an op this worker's torch lacks: its uses fail with why
            self.ops[msg.op] = _Undefined(msg.op, e)

    def RunOp(self, msg: m.RunOp) -> None:
        op = self.ops.get(msg.op) or _Undefined(msg.op)
        cells = [self._cell(r) for r in msg.refs]
        result = self.env[msg.result] = Cell()

        def work():
            return op.run([get_value(c) for c in cells])

        self._stream(msg.stream).schedule(msg.ident, op.what, work, (result,))

    def DefineRecording(self, msg: m.DefineRecording) -> None:
        from .recording import Recording

        self.recordings[msg.recording] = Recording(msg)

    def CallRecording(self, msg: m.CallRecording) -> None:
        self.recordings[msg.recording].call(self, msg)
