"""Recordings: commands captured once by the controller, replayed here with new inputs.

A replay runs each stream's recorded commands as one command on that stream.
Each command is prepared once, at definition: its function resolved, its
arguments unpickled with Refs left as slots that a replay fills from its
values. A value made inside a replay is dropped after its last reader unless
it is a result.

Failures never leave a peer inside a collective: a failing command makes its
result a DependentOnError of the replay (commands that read it fail silently)
and is reported once, after the replay; an input that failed before the replay
stays the DependentOnError it holds. A recorded reduce takes part either way,
and its header exchange tells every rank of the group that some input failed,
so all of them skip the data exchange and fail with the original error. An
input this rank has no value for (a Ref on other ranks only) fails only the
commands that read it, with MissingRef.
"""

from __future__ import annotations

from operator import getitem

from ..protocol import messages as m
from ..protocol.aten import OpSlot
from ..protocol.wire import resolve_function, unpack_args
from .code import run_source
from .ref_cell import Cell, DependentOnError, MissingRef, fail_written, shares, storages
from .slots import fill, slot_keys


class _Missing(DependentOnError):
    """The value of an input this rank does not hold: reading it is a failure
    (reported), not a dependence on one."""

    def __init__(self, ident: int, error: MissingRef):
        super().__init__(ident)
        self.error = error


def _call_runner(fn, args: tuple, kwargs: dict):
    """``run(values, worker, ident)`` for a CallFunction: flat Refs are filled in
    by position, nested ones rebuilt per replay, arguments without Refs reused."""
    slots = [(i, a.i) for i, a in enumerate(args) if type(a) is OpSlot]
    nested = any(type(a) is not OpSlot and slot_keys(a, set()) for a in args)
    if nested or slot_keys(kwargs, set()):
        return lambda values, worker, ident: fn(*fill(args, values), **fill(kwargs, values))
    if not slots:
        return lambda values, worker, ident: fn(*args, **kwargs)

    def run(values, worker, ident):
        a = list(args)
        for i, rid in slots:
            v = values[rid]
            if isinstance(v, DependentOnError):
                raise v
            a[i] = v
        return fn(*a, **kwargs)

    return run


def _reduce_runner(msg: m.Reduce):
    def run(values, worker, ident):
        from .reductions import run_reduce

        value = values.get(msg.source)
        out = None if msg.out is None else values.get(msg.out)
        missing = next((v for v in (value, out) if type(v) is _Missing), None)
        try:
            return run_reduce(msg, worker.comms, value, out)
        except DependentOnError:
            if missing is None:
                raise
        raise missing.error  # this rank's own failure; its peers depend on it

    return run


FLOATS = -1  # the key of a call's lifted floats among a replay's values (ids are > 0)


def _op_runner(op, refs: tuple, scalars: tuple, at: int):
    """A tensor op (a RunOps entry): its template on the values of ``refs``, then its
    scalars: the recorded ones, or those of the call (``values[FLOATS]``) from ``at``."""
    n = len(scalars)

    def run(values, worker, ident):
        args = []
        for rid in refs:
            v = values[rid]
            if isinstance(v, DependentOnError):
                raise v
            args.append(v)
        if n:
            floats = values.get(FLOATS)
            args.extend(floats[at : at + n] if floats else scalars)
        return op.run(args)

    if not op.writes:
        return run
    written = [refs[j] for j in op.writes]

    def run_writing(values, worker, ident):
        try:
            return run(values, worker, ident)
        except BaseException as e:  # noqa: B036 - what it wrote fails too, then the op
            failed = DependentOnError(e.ident if isinstance(e, DependentOnError) else ident)
            keys = storages([values.get(rid) for rid in written])
            for rid in values:
                if rid in written or shares(values[rid], keys):
                    values[rid] = failed
            raise

    return run_writing


def _step(msg, ops: dict, at: int) -> tuple:
    """(function, first, rest, result id, ids of the Refs it reads) of one recorded
    command (``ops``: the worker's op templates, for a tensor op; ``at``: where its
    lifted floats start in a call's). With ``first`` (a ref id), the step is
    ``function(values[first], *rest)``, run in the replay loop itself (the common
    ``f(ref, constants)``); without, ``function(values, worker, ident)``."""
    if type(msg) is tuple:  # a tensor op
        _, result, op_id, refs, _, scalars = msg
        op = ops.get(op_id)
        if op is None:
            raise RuntimeError(f"tensor op {op_id} was never defined on this worker")
        return _op_runner(op, refs, scalars, at), None, (), result, set(refs)
    kind = type(msg).__name__
    if kind == "CallFunction":
        fn = resolve_function(msg.function)
        args, kwargs = unpack_args(msg.args, OpSlot)
        reads = slot_keys((args, kwargs), set())
        if args and type(args[0]) is OpSlot and not kwargs and not slot_keys(args[1:], set()):
            return fn, args[0].i, args[1:], msg.result, reads
        return _call_runner(fn, args, kwargs), None, (), msg.result, reads
    if kind == "Reduce":
        reads = {msg.source} | ({msg.out} if msg.out is not None else set())
        return _reduce_runner(msg), None, (), msg.result, reads
    if kind == "RunCode":
        source, filename = msg.source, msg.filename

        def run_code(values, worker, ident):
            return run_source(source, filename, worker.namespace)

        return run_code, None, (), msg.result, set()
    raise RuntimeError(f"{kind} cannot be replayed")


class Recording:
    """The commands of one recording that concern this rank, per stream."""

    def __init__(self, msg: m.DefineRecording, ops: dict):
        self.name = msg.name
        self.what = f"compiled {msg.name}"
        self._steps: dict[int, list[tuple]] = {}  # stream id -> [_step(command)]
        self.writes = False  # whether an op writes values it does not return
        for cmd, at in zip(msg.commands, msg.floats_at):
            sid = cmd[4] if type(cmd) is tuple else cmd.stream
            if type(cmd) is tuple and getattr(ops.get(cmd[2]), "writes", ()):
                self.writes = True
            steps = self._steps.setdefault(sid, [])
            step = _step(cmd, ops, at)
            if type(step[3]) is not tuple:
                steps.append(step)
                continue
            # several results (an op of many outputs): the value under a key of its own (< -1),
            # then each result its item
            whole = -2 - sum(len(s) for s in self._steps.values())
            steps.append((*step[:3], whole, step[4]))
            steps.extend((getitem, whole, (i,), rid, {whole}) for i, rid in enumerate(step[3]))
        self.produces = {sid: {s[3] for s in steps} for sid, steps in self._steps.items()}
        self.reads = {
            sid: set().union(*(s[4] for s in steps)) for sid, steps in self._steps.items()
        }
        self.produced_here = set().union(*self.produces.values())
        # stream id -> [(function, first, rest, result, ids to drop after it)]
        self.streams: dict[int, list[tuple]] = {}
        self._kept: frozenset | None = None

    def _plan(self, kept: frozenset) -> None:
        """Drop each value made inside a replay after its last reader (unless it
        is a result): the replay holds no more memory than the calls sent one
        by one would."""
        self._kept = kept
        for sid, steps in self._steps.items():
            last = {}
            for i, (*_, result, reads) in enumerate(steps):
                last[result] = i
                for rid in reads:
                    if rid in last:
                        last[rid] = i
            drops: list[list] = [[] for _ in steps]
            for rid, i in last.items():
                if rid not in kept:
                    drops[i].append(rid)
            self.streams[sid] = [(*s[:4], tuple(d)) for s, d in zip(steps, drops)]

    def call(self, worker, msg: m.CallRecording) -> None:
        """Schedule one replay per stream (the CallRecording handler). Only the
        results this rank produces get cells."""
        env, ident = worker.env, msg.ident
        kept = frozenset(rid for rid, _ in msg.results)
        if kept != self._kept:  # the same for every call of a recording: planned once
            self._plan(kept)
        outputs = {}
        for rid, new in msg.results:
            if rid in self.produced_here:
                outputs[rid] = env[new] = Cell()
        for sid in self.streams:
            reads = self.reads[sid]
            inputs = [(rid, worker._cell(actual)) for rid, actual in msg.inputs if rid in reads]
            produced = [(rid, c) for rid, c in outputs.items() if rid in self.produces[sid]]

            def work(sid=sid, inputs=inputs, produced=produced):
                values = {FLOATS: msg.floats}
                for rid, cell in inputs:
                    v = cell.value
                    values[rid] = _Missing(ident, v) if isinstance(v, MissingRef) else v
                try:
                    self.replay(worker, sid, ident, values)
                finally:
                    for rid, c in produced:
                        c.set(values.get(rid, DependentOnError(ident)))
                    if self.writes:  # an input a failing op wrote fails here too
                        fail_written(inputs, values, env)

            worker._stream(sid).schedule(ident, self.what, work)

    def replay(self, worker, stream_id: int, ident: int, values: dict) -> None:
        """Run this stream's steps; ``values`` maps recorded ref ids to values
        (formals and captured Refs in; results out)."""
        first_failure = None
        for fn, first, rest, result, drops in self.streams.get(stream_id, ()):
            try:
                if first is None:
                    values[result] = fn(values, worker, ident)
                else:
                    v = values[first]
                    if isinstance(v, DependentOnError):
                        raise v
                    # fn(v) keeps a Python function on the interpreter's fast call path
                    values[result] = fn(v, *rest) if rest else fn(v)
            except DependentOnError as e:
                if type(e) is _Missing:
                    values[result] = DependentOnError(ident)
                    if first_failure is None:
                        first_failure = e.error
                else:
                    values[result] = e
            except BaseException as e:  # noqa: B036 - reported once, after the replay
                values[result] = DependentOnError(ident)
                if first_failure is None:
                    first_failure = e
            for rid in drops:
                del values[rid]
        if first_failure is not None:
            raise first_failure
