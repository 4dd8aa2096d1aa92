"""Recordings: commands captured once by the controller, replayed here with new inputs.

A replay runs each stream's recorded commands as one command on that stream:
functions are resolved and arguments unpickled once, at definition, with Refs
left as slots that a replay fills. A failing command makes its result a
DependentOnError of the replay (commands that read it fail silently) and is
reported once; collectives still take part, so no rank hangs.
"""

from __future__ import annotations

from ..protocol import messages as m
from ..protocol.wire import resolve_function, unpack_args
from .cell import DependentOnError
from .code import run_source


class _Slot:
    __slots__ = ("rid",)

    def __init__(self, rid: int):
        self.rid = rid


def _has_slot(obj) -> bool:
    if type(obj) is _Slot:
        return True
    if type(obj) in (tuple, list):
        return any(_has_slot(o) for o in obj)
    if type(obj) is dict:
        return any(_has_slot(v) for v in obj.values())
    return False


def _bind(obj, values: dict):
    t = type(obj)
    if t is _Slot:
        v = values[obj.rid]
        if type(v) is DependentOnError:
            raise v
        return v
    if t is tuple:
        return tuple(_bind(o, values) for o in obj)
    if t is list:
        return [_bind(o, values) for o in obj]
    if t is dict:
        return {k: _bind(v, values) for k, v in obj.items()}
    return obj


def _flat_slots(args: tuple) -> list | None:
    """Positions of the Refs in a flat argument tuple, or None if some are nested."""
    slots = []
    for i, a in enumerate(args):
        if type(a) is _Slot:
            slots.append((i, a.rid))
        elif _has_slot(a):
            return None
    return slots


class _Step:
    """One recorded command, ready to run."""

    __slots__ = ("kind", "result", "fn", "args", "kwargs", "slots", "nested", "msg")

    def __init__(self, msg):
        self.msg = msg
        self.kind = type(msg).__name__
        self.result = getattr(msg, "result", None)
        self.fn = None
        self.args, self.kwargs, self.slots, self.nested = (), {}, [], False
        if self.kind == "CallFunction":
            self.fn = resolve_function(msg.function)
            self.args, self.kwargs = unpack_args(msg.args, _Slot)
            # arguments without Refs are reused as they are; flat Refs are filled in
            # by position; anything nested is rebuilt per replay
            slots = _flat_slots(self.args)
            self.nested = slots is None or _has_slot(self.kwargs)
            self.slots = slots or []


class Recording:
    """The commands of one recording that concern this rank, per stream."""

    def __init__(self, msg: m.DefineRecording):
        self.name = msg.name
        self.streams: dict[int, list[_Step]] = {}
        self.produces: dict[int, set] = {}  # stream id -> recorded ids its steps define
        for cmd in msg.commands:
            self.streams.setdefault(cmd.stream, []).append(_Step(cmd))
            self.produces.setdefault(cmd.stream, set()).add(cmd.result)

    def replay(self, worker, stream_id: int, ident: int, values: dict) -> None:
        """Run this stream's steps; ``values`` maps recorded ref ids to values
        (formals and captured Refs in; results out)."""
        first_failure = None
        for step in self.streams.get(stream_id, ()):
            try:
                if step.fn is not None and not step.nested:
                    args = step.args
                    if step.slots:
                        args = list(args)
                        for i, rid in step.slots:
                            v = values[rid]
                            if type(v) is DependentOnError:
                                raise v
                            args[i] = v
                    values[step.result] = step.fn(*args, **step.kwargs)
                    continue
                values[step.result] = self._run(worker, step, values)
            except DependentOnError as e:
                if step.result is not None:
                    values[step.result] = e
            except BaseException as e:  # noqa: B036 - reported once, after the replay
                if step.result is not None:
                    values[step.result] = DependentOnError(ident)
                if first_failure is None:
                    first_failure = e
        if first_failure is not None:
            raise first_failure

    @staticmethod
    def _run(worker, step: _Step, values: dict):
        kind = step.kind
        if kind == "CallFunction":
            return step.fn(*_bind(step.args, values), **_bind(step.kwargs, values))
        msg = step.msg
        if kind == "Reduce":
            from .collectives import run_reduce

            out = None if msg.out is None else values.get(msg.out)
            return run_reduce(msg, worker.comms, values.get(msg.source), out)
        if kind == "RunCode":
            return run_source(msg.source, msg.filename, worker.namespace)
        raise RuntimeError(f"{kind} cannot be replayed")
