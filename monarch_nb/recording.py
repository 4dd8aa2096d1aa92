"""``mnb.compile``: record the remote commands a function issues once, then replay
them with one message per call.

The first call with a given shape of arguments runs normally and records every
command it sends (remote calls, ``exec``, reductions, on any streams). Later
calls send one CallRecording that each worker replays locally with the new
Refs; values made inside the function and not returned never reach the
workers' env. Arguments that are not Refs are part of the recording: calling
with different ones records again (like a guard). Fetching inside a compiled
function is an error: a replay cannot stop to talk to the controller.
"""

from __future__ import annotations

import functools
import pickle
from typing import Any

from .context import recording_trace
from .protocol import messages as m
from .remote import Ref

RECORDABLE = ("CallFunction", "Reduce", "RunCode")


class RecordingError(RuntimeError):
    """Something a compiled function did cannot be recorded."""


class _Trace:
    def __init__(self, ctrl):
        self.ctrl = ctrl
        self.commands: list = []  # (msg, targets)
        self.refs: dict[int, Ref] = {}  # every Ref the recorded commands name

    def observe(self, msg, targets) -> None:
        kind = type(msg).__name__
        if kind not in RECORDABLE:
            what = {"SendValue": "fetch()", "Pull": "pull()"}.get(kind, kind)
            raise RecordingError(f"{what} cannot be used inside a compiled function")
        self.commands.append((msg, tuple(targets)))

    def note(self, refs) -> None:
        for r in refs:
            self.refs[r.id] = r


def _walk(obj, refs: list):
    """A hashable description of ``obj`` with each Ref replaced by its place
    (mesh ranks and stream); the Refs are appended to ``refs``."""
    t = type(obj)
    if t is Ref:
        refs.append(obj)
        return ("ref", obj.mesh.targets, obj.stream.id)
    if t in (tuple, list):
        return (t.__name__, tuple(_walk(o, refs) for o in obj))
    if t is dict:
        return ("dict", tuple((k, _walk(v, refs)) for k, v in obj.items()))
    try:
        return ("value", pickle.dumps(obj, 5))
    except Exception:
        return ("object", id(obj))


def _template(obj, defined: set, formals: list):
    """The result structure: a Ref made inside becomes ("ref", recorded id, mesh,
    stream); a Ref passed in, ("formal", its position); any other Ref is returned as is."""
    t = type(obj)
    if t is Ref:
        if obj.id in defined:
            return ("ref", obj.id, obj.mesh, obj.stream)
        if obj.id in formals:
            return ("formal", formals.index(obj.id))
        return ("const", obj)
    if t in (tuple, list):
        return (t.__name__, [_template(o, defined, formals) for o in obj])
    if t is dict:
        return ("dict", {k: _template(v, defined, formals) for k, v in obj.items()})
    return ("const", obj)


def _build(tpl, new_ids: dict, ident: int, actuals: list):
    kind = tpl[0]
    if kind == "ref":
        _, rid, mesh, stream = tpl
        return Ref(new_ids[rid], mesh, stream, ident)
    if kind == "formal":
        return actuals[tpl[1]]
    if kind in ("tuple", "list"):
        items = [_build(t, new_ids, ident, actuals) for t in tpl[1]]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return {k: _build(v, new_ids, ident, actuals) for k, v in tpl[1].items()}
    return tpl[1]


class _Recorded:
    def __init__(self, rid: int, ctrl, generation: int):
        self.id = rid
        self.ctrl = ctrl
        self.generation = generation
        self.formals: list[int] = []
        self.captured: list[Ref] = []  # kept alive: replays read them
        self.results: list[int] = []
        self.template: Any = None
        self.targets: tuple = ()
        self.streams: dict[int, tuple] = {}  # stream id -> ranks


class Compiled:
    """A function whose remote commands are recorded once and replayed."""

    def __init__(self, fn):
        self._fn = fn
        self._recorded: dict = {}
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args, **kwargs):
        refs: list[Ref] = []
        key = _walk((args, kwargs), refs)
        for r in refs:
            r._check()
        if recording_trace.active is not None:
            raise RecordingError("a compiled function cannot be called while another one records")
        rec = self._recorded.get(key)
        if rec is not None and rec.generation == rec.ctrl.generation and rec.ctrl.usable:
            return self._replay(rec, refs)
        return self._record(key, args, kwargs, refs)

    def _record(self, key, args, kwargs, refs: list[Ref]):
        from .mesh import get_mesh

        ctrl = refs[0].mesh._controller if refs else get_mesh()._controller
        trace = _Trace(ctrl)
        recording_trace.active = trace
        try:
            result = self._fn(*args, **kwargs)
        finally:
            recording_trace.active = None
        if not trace.commands:
            return result
        out_refs: list[Ref] = []
        _walk(result, out_refs)
        defined = {msg.result for msg, _ in trace.commands}
        formal_ids = [r.id for r in refs]
        used = set()
        for msg, _ in trace.commands:
            if type(msg).__name__ == "CallFunction" and msg.args is not None:
                used.update(msg.args.refs)
            elif type(msg).__name__ == "Reduce":
                used.add(msg.source)
                if msg.out is not None:
                    used.add(msg.out)
        rec = _Recorded(ctrl.next_id(), ctrl, ctrl.generation)
        rec.formals = formal_ids
        rec.captured = [
            trace.refs[i] for i in sorted(used - defined - set(formal_ids)) if i in trace.refs
        ]
        rec.results = [r.id for r in out_refs if r.id in defined]
        rec.template = _template(result, defined, formal_ids)
        ranks = sorted({r for _, targets in trace.commands for r in targets})
        rec.targets = tuple(ranks)
        for msg, targets in trace.commands:
            prev = rec.streams.get(msg.stream, ())
            rec.streams[msg.stream] = tuple(sorted(set(prev) | set(targets)))
        name = getattr(self._fn, "__name__", "compiled")
        for r in ranks:
            mine = tuple(msg for msg, targets in trace.commands if r in targets)
            ctrl.send(m.DefineRecording(rec.id, name, mine), [r])
        self._recorded[key] = rec
        return result

    def _replay(self, rec: _Recorded, refs: list[Ref]):
        ctrl = rec.ctrl
        ctrl.check_usable()
        ident = ctrl.next_ident()
        inputs = tuple(zip(rec.formals, (r.id for r in refs))) + tuple(
            (c.id, c.id) for c in rec.captured
        )
        new_ids = {rid: ctrl.next_id() for rid in rec.results}
        what = f"compiled {getattr(self._fn, '__name__', '')}"
        for sid, ranks in rec.streams.items():
            ctrl.state.record_sent(ident, sid, ranks, what)
        ctrl.send(m.CallRecording(ident, rec.id, inputs, tuple(new_ids.items())), rec.targets)
        return _build(rec.template, new_ids, ident, refs)

    def __repr__(self) -> str:
        return f"<compiled {getattr(self._fn, '__qualname__', self._fn)!r}>"


def compile(fn=None):  # noqa: A001 - the public name, as in torch.compile
    """``@mnb.compile``: record the function's remote commands once, replay them per call."""
    if fn is None:
        return Compiled
    return Compiled(fn)
