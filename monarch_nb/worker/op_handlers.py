"""The worker's handlers of tensor ops (DefineOp, RunOps) and recordings (a part of
Worker, which dispatches each message to the handler of its name).

A DefineOp is prepared once: its function resolved (an aten op to its
OpOverload) and its slots located, so that each op of a RunOps costs a list of
cells and one call.
"""

from __future__ import annotations

from ..protocol import messages as m
from ..protocol.aten import OpSlot, op_callable, run_op
from ..protocol.autograd import requiring, run_grad
from ..protocol.pickling import resolve_function
from .ref_cell import Cell, Written, get_value
from .slots import fill, slot_keys


class OpTemplate:
    """A defined op: ``run(values)`` calls it with ``values`` in its slots."""

    def __init__(self, msg: m.DefineOp):
        fn, args, kwargs = resolve_function(msg.function), tuple(msg.args), dict(msg.kwargs)
        if fn is run_op and args and type(args[0]) is str:
            fn, args = op_callable(args[0]), args[1:]  # the op itself: no lookup per call
        self.fn, self.args, self.kwargs, self.what = fn, args, kwargs, msg.what
        self.grad = msg.grad  # with autograd (the slots that require grad), or None
        self.writes = tuple(msg.writes)  # the slots it writes without returning them
        self._slots = [(i, a.i) for i, a in enumerate(args) if type(a) is OpSlot]
        self._nested = bool(slot_keys(kwargs, set())) or any(
            type(a) is not OpSlot and slot_keys(a, set()) for a in args
        )

    def run(self, values: list):
        grad = self.grad
        if grad is not None:
            values = requiring(values, grad)
        if self._nested:
            return run_grad(self.fn, grad, fill(self.args, values), fill(self.kwargs, values))
        a = list(self.args)
        for i, j in self._slots:
            a[i] = values[j]
        return run_grad(self.fn, grad, a, self.kwargs)


class _Undefined:
    """The template of an op id this worker never heard of (a controller bug)."""

    def __init__(self, op: int, error: BaseException | None = None):
        self.what, self.writes = f"op {op}", ()
        self.error = error or RuntimeError(f"tensor op {op} was never defined on this worker")

    def run(self, values: list):
        raise self.error


class _Spread:
    """The cells of an op with several results: each gets its item of the op's value
    (a tuple), or every one the failure."""

    __slots__ = ("cells",)

    def __init__(self, cells: list):
        self.cells = cells

    def set(self, value) -> None:
        if (type(value) is tuple or type(value) is list) and len(value) == len(self.cells):
            for c, v in zip(self.cells, value):
                c.set(v)
        else:
            for c in self.cells:
                c.set(value)


def _work(op, cells: list, scalars: tuple):
    """What a stream runs for one op: ``op`` on the values of ``cells``, then
    ``scalars`` (its lifted floats) in the slots after theirs."""
    if scalars:

        def work():
            return op.run([*[get_value(c) for c in cells], *scalars])

        return work

    def work():
        return op.run([get_value(c) for c in cells])

    return work


class OpHandlers:
    """Handlers of DefineOp, RunOps, DefineRecording, CallRecording, DeleteRecording and
    ForgetDefinitions."""

    def DefineOp(self, msg: m.DefineOp) -> None:
        try:
            self.ops[msg.op] = OpTemplate(msg)
        except Exception as e:  # an op this worker's torch lacks: its uses fail with why
            self.ops[msg.op] = _Undefined(msg.op, e)

    def RunOps(self, msg: m.RunOps) -> None:
        """Each op is a command of its own; the ops of one stream queue as one item."""
        ops, env, cell = self.ops, self.env, self._cell
        queued: dict[int, list] = {}  # stream id -> commands, in order
        for ident, result, op_id, refs, sid, scalars in msg.ops:
            op = ops.get(op_id) or _Undefined(op_id)
            if type(result) is tuple:  # several values (an op of many outputs)
                items = [Cell() for _ in result]
                env.update(zip(result, items))
                out = _Spread(items)
            else:
                out = env[result] = Cell()
            commands = queued.get(sid)
            if commands is None:
                commands = queued[sid] = []
            cells = [cell(r) for r in refs]
            results = (out, Written([cells[j] for j in op.writes], env)) if op.writes else (out,)
            commands.append((ident, op.what, _work(op, cells, scalars), results, True))
        for sid, commands in queued.items():
            self._stream(sid).schedule_many(commands)

    def DefineRecording(self, msg: m.DefineRecording) -> None:
        from .recording import Recording

        self.recordings[msg.recording] = Recording(msg, self.ops)

    def CallRecording(self, msg: m.CallRecording) -> None:
        self.recordings[msg.recording].call(self, msg)

    def DeleteRecording(self, msg: m.DeleteRecording) -> None:
        self.recordings.pop(msg.recording, None)

    def ForgetDefinitions(self, msg: m.ForgetDefinitions) -> None:
        self.ops.clear()
        self.recordings.clear()
