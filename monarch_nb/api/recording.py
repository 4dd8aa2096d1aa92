"""``mnb.compile``: record the remote commands a function issues once, then replay
them with one message per call.

The first call with a given shape of arguments runs normally and records every command
it sends (remote calls, ``exec``, reductions, on any streams). Later calls send one
CallRecording that each worker replays locally with the new Refs; values made inside the
function and not returned never reach the workers' env. Arguments that are not Refs are
part of the recording: calling with different ones records again (like a guard). A call
that fetches (``t.item()``, ``fetch()``) runs op by op from there (torch.compile's graph
break). Mesh tensors a call leaves behind (parameters updated in place, gradients,
optimizer state: the recording's *state*) are rebound to the replay's new values, so the
controller's tensors name what the workers hold. A function with state is replayed only
once two recorded calls in a row sent the same commands (an optimizer's first step,
which creates its state, differs from the next); one that never settles runs uncompiled,
with a warning. Each later call runs the function's Python with its commands held back,
then sends them as one CallRecording (a *checked* call): a scheduler's step, an
optimizer's step count, a counter and a global the function reads advance as eagerly,
and the lifted floats they feed are each call's own. Only ``pure=True`` (the caller's
promise that the Python has no other effect and reads nothing that changes) lets a call
replay without running it, as a CUDA graph replays.
"""

from __future__ import annotations

import functools
import pickle
import sys
import warnings
import weakref
from typing import Any

from ..protocol import messages as m
from .context import recording_trace
from .recorded import RecordingError, Signature, Trace, fields, results_of
from .remote import Ref

__all__ = ["Compiled", "RecordingError", "compile"]

MAX_ATTEMPTS = 4  # recordings in a row of a function with state that do not settle
MAX_RECORDINGS = 8  # per compiled function: the older ones are freed on the workers


def _walk(obj, refs: list):
    """A hashable description of ``obj`` with each Ref replaced by its place
    (mesh ranks and stream); the Refs are appended to ``refs``."""
    t = type(obj)
    if t is Ref or _is_tensor(obj):
        refs.append(obj)
        layout = getattr(obj, "_layout", None)  # its storage offset is no guard: slices
        return ("ref", obj.mesh.targets, obj.stream.id, layout and (*layout[:2], *layout[3:]))
    if t in (tuple, list):
        return (t.__name__, tuple(_walk(o, refs) for o in obj))
    if t is dict:
        return ("dict", tuple((k, _walk(v, refs)) for k, v in obj.items()))
    if _is_torch_object(obj):  # a module or an optimizer: its tensors are state, not guards
        return ("object", id(obj))
    try:
        return ("value", pickle.dumps(obj, 5))
    except Exception:
        return ("object", id(obj))


def _refs_in(obj, refs: list) -> list:
    """The Refs (mesh tensors among them) in ``obj`` and its tuples, lists and dicts,
    appended to ``refs``."""
    t = type(obj)
    if t is Ref or _is_tensor(obj):
        refs.append(obj)
    elif t in (tuple, list):
        for o in obj:
            _refs_in(o, refs)
    elif t is dict:
        for o in obj.values():
            _refs_in(o, refs)
    return refs


def _is_tensor(obj) -> bool:
    """A mesh tensor (``mnb.Tensor``): the one kind of Ref with a layout (tested
    without importing the tensor engine, which imports torch)."""
    return isinstance(obj, Ref) and hasattr(obj, "_layout")


def _is_torch_object(obj) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, (torch.nn.Module, torch.optim.Optimizer))


def _template(obj, defined: set, formals: list, state: set):
    """The result structure: a Ref made inside becomes ("ref", recorded id, mesh,
    stream) (a mesh tensor, ("tensor", ..., layout)); a Ref passed in, ("formal",
    its position); a state tensor, ("obj", weakref); any other Ref is returned as is."""
    t = type(obj)
    if t is Ref or _is_tensor(obj):
        if id(obj) in state:
            return ("obj", weakref.ref(obj))
        if obj.id in defined:
            if t is Ref:
                return ("ref", obj.id, obj.mesh, obj.stream)
            return ("tensor", obj.id, obj.mesh, obj.stream, obj._layout)
        if obj.id in formals:
            return ("formal", formals.index(obj.id))
        return ("const", obj)
    if t in (tuple, list):
        return (t.__name__, [_template(o, defined, formals, state) for o in obj])
    if t is dict:
        return ("dict", {k: _template(v, defined, formals, state) for k, v in obj.items()})
    return ("const", obj)


def _build(tpl, new_ids: dict, ident: int, actuals: list):
    kind = tpl[0]
    if kind == "ref":
        _, rid, mesh, stream = tpl
        return Ref(new_ids[rid], mesh, stream, ident)
    if kind == "tensor":
        _, rid, mesh, stream, layout = tpl
        from .tensor import Tensor  # a recording with mesh tensors: the engine is loaded

        return Tensor(layout, new_ids[rid], mesh, stream, ident)
    if kind == "obj":
        return tpl[1]()
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
        self.captured: list[tuple] = []  # (recorded id, Ref, or weakref to a mesh tensor)
        self.state: list[tuple] = []  # (recorded id, weakref): mesh tensors left behind
        self.results: list[int] = []
        self.template: Any = None
        self.targets: tuple = ()
        self.streams: dict[int, tuple] = {}  # stream id -> ranks
        self.signature: Signature | None = None  # what it sends
        self.confirmed = True
        self.checked = False  # each call runs its Python, held, and checks what it sent

    def usable(self) -> bool:
        return self.generation == self.ctrl.generation and self.ctrl.usable

    def inputs(self) -> tuple | None:
        """(recorded id, actual id) of each captured value now; None when a captured
        tensor is gone (the recording no longer describes the program). A state tensor
        may be gone: nothing reads it (an activation the returned loss's graph held)."""
        pairs = []
        for rid, ref in self.captured:
            if type(ref) is weakref.ReferenceType:
                ref = ref()
                if ref is None or ref._deleted:
                    return None
            pairs.append((rid, ref.id))
        return tuple(pairs)


class Compiled:
    """A function whose remote commands are recorded once and replayed."""

    def __init__(self, fn, pure: bool = False):
        self._fn = fn
        self._pure = pure  # its settled calls replay without running its Python
        self._recorded: dict = {}  # key -> _Recorded, the most recent last
        self._attempts: dict = {}  # key -> recordings in a row that did not settle
        self._why = ""  # how the last two recordings of a key differed
        self._left: set = set()  # (what, where) a call asked the workers, warned once
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args, **kwargs):
        refs: list[Ref] = []
        key = _walk((args, kwargs), refs)
        for r in refs:
            r._check()
        if recording_trace.active is not None:
            raise RecordingError("a compiled function cannot be called while another one records")
        rec = self._recorded.get(key)
        if rec is not None and rec.confirmed and rec.usable():
            if rec.checked:
                done, result = self._checked_call(rec, args, kwargs, refs)
                if done:
                    self._attempts[key] = 0
                    return result
                return self._settle(key, rec, *result)
            captured = rec.inputs()
            if captured is not None:
                self._attempts[key] = 0
                return self._replay(rec, refs, captured)
            rec = None  # stale: what it read is gone
        attempts = self._attempts.get(key, 0)
        if attempts >= MAX_ATTEMPTS:  # warned once: it runs uncompiled
            return self._fn(*args, **kwargs)
        return self._settle(key, rec, *self._record(args, kwargs, refs))

    def _settle(self, key, rec, result, new):
        """Keep recording ``new`` of ``key`` (after ``rec``): a function with state is
        confirmed by the same commands twice (floats aside). Each later call is checked
        (its Python runs), unless the function is pure (and, with state, its floats
        were the same twice)."""
        if new is None:
            return result
        if new.state:  # a replay resets the count
            prev = rec.signature if rec is not None else None
            new.confirmed = prev is not None and prev.same_as(new.signature, floats=False)
            new.checked = new.confirmed and (
                not self._pure or not prev.same_as(new.signature)
            )
            attempts = self._attempts[key] = self._attempts.get(key, 0) + 1
            if not new.confirmed and prev is not None:
                self._why = prev.difference(new.signature)
            if not new.confirmed and attempts >= MAX_ATTEMPTS:
                self._warn_unsettled()
        else:  # settled at once: nothing it made outlives a call but its results
            new.checked = not self._pure
        self._keep(key, new)
        return result

    def _keep(self, key, rec: _Recorded) -> None:
        """``rec`` for ``key``; the recording it replaces, and the oldest beyond
        MAX_RECORDINGS, are freed on the workers."""
        old = [self._recorded.pop(key, None)]
        self._recorded[key] = rec
        while len(self._recorded) > MAX_RECORDINGS:
            old.append(self._recorded.pop(next(iter(self._recorded))))
        for r in old:
            if r is not None and r.usable():
                r.ctrl.send(m.DeleteRecording(r.id), r.targets, check=False)

    def _warn_unsettled(self) -> None:
        name = getattr(self._fn, "__qualname__", "the function")
        warnings.warn(
            f"mnb.compile: {name} sends different commands on each call, so it runs "
            f"uncompiled from now on: {self._why or 'the tensors it reads do not outlive a call'}"
            f"; values computed in Python per call that are not a tensor op's floats (a step "
            f"count as an int, a layout) belong in its arguments",
            RuntimeWarning,
            stacklevel=4,
        )

    def _warn_left(self, left: tuple) -> None:
        if left not in self._left:
            self._left.add(left)
            warnings.warn(
                f"mnb.compile: {getattr(self._fn, '__qualname__', 'the function')} asks the "
                f"workers for a value ({left[0]}, at {left[1]}), which a replay cannot stop "
                f"for, so each call that asks runs op by op (with the same numbers); for every "
                f"call to replay, read the value outside the compiled function (return it)",
                RuntimeWarning,
                stacklevel=4,
            )

    def _record(self, args, kwargs, refs: list[Ref]):
        from .mesh import get_mesh

        ctrl = refs[0].mesh._controller if refs else get_mesh()._controller
        trace = Trace(ctrl)
        recording_trace.active = trace
        try:
            result = self._fn(*args, **kwargs)
        finally:
            recording_trace.active = None
        if trace.left is not None:
            self._warn_left(trace.left)
            return result, None
        if not trace.commands:
            return result, None
        out_refs = _refs_in(result, [])
        described = [fields(c) for c, _, _ in trace.commands]
        defined = {rid for result, _, _ in described for rid in results_of(result)}
        formal_ids = [r.id for r in refs]
        used = set()
        for _, reads, _ in described:
            used.update(reads)
        rec = _Recorded(ctrl.next_id(), ctrl, ctrl.generation)
        rec.formals = formal_ids
        for i in sorted(used - defined - set(formal_ids)):
            if i in trace.refs:
                rec.captured.append((i, trace.refs[i]))
            elif i in trace.tensors:
                rec.captured.append((i, trace.tensors[i]))
        returned = {id(r) for r in out_refs}
        made = {id(t) for t in (w() for w in trace.made) if t is not None}
        state: dict[int, tuple] = {}  # id(tensor) -> (its recorded id, weakref)
        for w in [*trace.tensors.values(), *trace.made]:
            t = w()
            if t is None or t._deleted or t.id not in defined or id(t) in state:
                continue
            if id(t) in returned and id(t) in made:
                continue  # a new result: each replay makes its own
            state[id(t)] = (t.id, w)
        rec.state = list(state.values())
        rec.results = list(
            dict.fromkeys([r.id for r in out_refs if r.id in defined] + [i for i, _ in rec.state])
        )
        rec.template = _template(result, defined, formal_ids, set(state) & returned)
        ranks = sorted({r for _, targets, _ in trace.commands for r in targets})
        rec.targets = tuple(ranks)
        for (_, targets, _), (_, _, sid) in zip(trace.commands, described):
            rec.streams[sid] = tuple(sorted(set(rec.streams.get(sid, ())) | set(targets)))
        rec.signature = Signature(trace.commands)
        name = getattr(self._fn, "__name__", "compiled")
        at, floats_at = 0, []
        for command, _, _ in trace.commands:
            n = len(command[5]) if type(command) is tuple else 0
            floats_at.append(at if n else -1)
            at += n
        for r in ranks:
            mine = [(c, f) for (c, t, _), f in zip(trace.commands, floats_at) if r in t]
            msg = m.DefineRecording(rec.id, name, *map(tuple, zip(*mine)))
            ctrl.send(msg, [r])
        return result, rec

    def _replay(self, rec: _Recorded, refs: list[Ref], captured: tuple):
        ctrl = rec.ctrl
        ctrl.check_usable()
        ident = ctrl.next_ident()
        inputs = tuple(zip(rec.formals, (r._wire_id() for r in refs))) + captured
        new_ids = {rid: ctrl.next_id() for rid in rec.results}
        self._sent(rec, ident)
        ctrl.send(m.CallRecording(ident, rec.id, inputs, tuple(new_ids.items()), ()), rec.targets)
        for rid, w in rec.state:  # after the replay is sent: the old values go after it
            t = w()
            if t is None or t._deleted:
                ctrl.delete_ref(new_ids[rid])  # a state tensor gone: its new value too
            else:
                t._rebind(new_ids[rid], ident)
        return _build(rec.template, new_ids, ident, refs)

    def _sent(self, rec: _Recorded, ident: int) -> None:
        what = f"compiled {getattr(self._fn, '__name__', '')}"
        for sid, ranks in rec.streams.items():
            rec.ctrl.state.record_sent(ident, sid, ranks, what)

    def _checked_call(self, rec: _Recorded, args, kwargs, refs: list[Ref]) -> tuple:
        """Run the function with its commands held back. When it sent what ``rec`` holds
        (its floats aside), send one CallRecording with this call's floats: ``(True,
        result)``; else send the commands as they are: ``(False, (result, recording))``."""
        ctrl = rec.ctrl
        trace = Trace(ctrl, hold=True)
        recording_trace.active = trace
        try:
            result = self._fn(*args, **kwargs)
        except BaseException:
            recording_trace.active = None
            trace.flush()
            raise
        recording_trace.active = None
        if trace.left is not None:
            self._warn_left(trace.left)
            return True, result
        sig = Signature(trace.commands)
        if not rec.usable() or not rec.signature.same_as(sig, floats=False):
            self._why = rec.signature.difference(sig)
            trace.flush()
            return False, (result, None)
        deleted = set(trace.deletes)
        inputs, results = [], []
        for recorded, actual in zip(rec.signature.ids, sig.ids):
            if recorded not in rec.signature.made:
                inputs.append((recorded, actual))
            elif actual not in deleted:
                results.append((recorded, actual))
        ident = ctrl.next_ident()
        self._sent(rec, ident)
        msg = m.CallRecording(ident, rec.id, tuple(inputs), tuple(results), sig.floats)
        ctrl.send(msg, rec.targets, check=False)
        for w in trace.made:
            t = w()
            if t is not None:
                t.ident = ident
        for r in _refs_in(result, []):  # a Ref made inside: its value comes from the replay
            if r.id in sig.made:
                r.ident = ident
        trace.release(sig.made)
        return True, result

    def __repr__(self) -> str:
        pure = ", pure" if self._pure else ""
        return f"<compiled {getattr(self._fn, '__qualname__', self._fn)!r}{pure}>"


def compile(fn=None, *, pure: bool = False):  # noqa: A001 - the public name, as in torch.compile
    """``@mnb.compile``: record the function's remote commands once, replay them per call.

    Each call runs the function's Python (its commands leave as one message);
    ``pure=True`` promises that Python has no effect but its commands and reads no
    value that changes (no scheduler, no counter), so replays skip it."""
    if not isinstance(pure, bool):
        raise TypeError(f"mnb.compile(pure=...) takes True or False, got {pure!r}")
    if fn is None:
        return functools.partial(Compiled, pure=pure)
    return Compiled(fn, pure=pure)
