"""What ``mnb.compile`` sees of a call: the commands it sent (its ``Trace``) and their
*signature*, which two calls share when they did the same thing.

A command is a message (CallFunction, Reduce, RunCode) or a tensor op, the RunOps
entry ``(ident, result, op, refs, stream, scalars)`` of an op template. A trace
either watches the commands go (a recording call: they run op by op) or *holds*
them (a checked call: they leave as one CallRecording, or, when the call did
something else, op by op after all, in their order). A held trace holds the
deletions of values too, so that none overtakes a command that reads the value.

A signature numbers the values a call names by first appearance, so two calls
that read and made the same values in the same places compare equal whatever
their ids; its ``floats`` (the lifted floats of the tensor ops: an optimizer's
learning rate and bias corrections, a schedule) are apart, so that calls which
differ only in them are replayed with each call's own.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref

from ..controller.frames import user_place
from ..protocol.pickling import unpack_args
from .context import RecordingError, recording_trace
from .remote import Ref

RECORDABLE = ("CallFunction", "Reduce", "RunCode")
_ASKS = {"SendValue": "fetch()", "Pull": "pull()"}  # a call that sends one leaves the recording
_ID_FIELDS = frozenset({"result", "source", "out"})


class Trace:
    """The commands a call sends, in order: ``(command, targets, what)``."""

    def __init__(self, ctrl, hold: bool = False):
        self.ctrl = ctrl
        self.hold = hold
        self.thread = threading.get_ident()
        self.left: tuple | None = None  # (what, where): the call left the recording
        self.commands: list = []
        self.deletes: list[int] = []  # value ids freed meanwhile (held)
        self.refs: dict[int, Ref] = {}  # every Ref the recorded commands name
        self.tensors: dict[int, weakref.ref] = {}  # ... and every mesh tensor (weakly)
        self.made: list[weakref.ref] = []  # mesh tensors made while recording

    def observe(self, command, targets, what: str = "") -> bool:
        """Take note of ``command`` on its way; True when it is held back."""
        if type(command) is not tuple:
            kind = type(command).__name__
            if kind in _ASKS:
                self.leave(_ASKS[kind])
                return False
            if kind not in RECORDABLE:
                raise RecordingError(f"{kind} cannot be used inside a compiled function")
        self.commands.append((command, tuple(targets), what))
        return self.hold

    def leave(self, what: str) -> None:
        """The call asks the workers for a value (``what``), which a replay cannot
        stop to do: it goes on uncompiled, as eagerly (what was held leaves first, in
        order), and records nothing. Another thread's ask is refused."""
        if threading.get_ident() != self.thread:
            raise RecordingError(
                f"{what} cannot be used on another thread while a compiled function records"
            )
        torch = sys.modules.get("torch")  # its frames too: the place is the caller's
        self.left = (what, user_place((os.path.dirname(torch.__file__),) if torch else ()))
        recording_trace.active = None
        if self.hold:
            self.flush()
        self.commands = []

    def holds_delete(self, ref_id: int) -> bool:
        if self.hold:
            self.deletes.append(ref_id)
        return self.hold

    def note(self, refs) -> None:
        if self.hold:  # a checked call: only a recording call defines inputs from them
            return
        for r in refs:
            if hasattr(r, "_layout"):
                self.tensors.setdefault(r.id, weakref.ref(r))
            else:
                self.refs[r.id] = r

    def flush(self) -> None:
        """Send what was held, as the call would have sent it (the trace inactive)."""
        ctrl, self.hold = self.ctrl, False
        for command, targets, what in self.commands:
            if type(command) is tuple:
                ctrl.send_op(command, targets, what)
            else:
                ctrl.send(command, targets, command.stream, what, check=False)
        self.release({})

    def release(self, defined: dict) -> None:
        """Free the values deleted meanwhile, but those ``defined`` by the call that
        a replay never made."""
        ctrl, self.hold = self.ctrl, False
        for rid in self.deletes:
            if rid not in defined:
                ctrl.delete_ref(rid)
        self.deletes = []


def results_of(result) -> tuple:
    """The ids a command's ``result`` names (a tensor op may have several)."""
    return result if type(result) is tuple else (result,)


def fields(command) -> tuple:
    """``(result, ids it reads, stream)`` of a command (``result``: see ``results_of``)."""
    if type(command) is tuple:
        return command[1], command[3], command[4]
    kind = type(command).__name__
    if kind == "CallFunction":
        return command.result, command.args.refs if command.args is not None else (), command.stream
    if kind == "Reduce":
        reads = (command.source,) if command.out is None else (command.source, command.out)
        return command.result, reads, command.stream
    return command.result, (), command.stream


class Signature:
    """What a call's commands did: ``skeleton`` (comparable, floats apart), ``floats``
    (every tensor op's lifted floats, in order), ``ids`` (the values named, in order
    of first appearance) and ``made`` (those the call made). ``skeleton`` is None when
    a command cannot be compared (arguments sent by value that do not compare)."""

    def __init__(self, commands: list):
        canon: dict[int, int] = {}
        made: set[int] = set()
        floats: list = []
        skeleton: list | None = []

        number = canon.setdefault

        def c(rid):
            return None if rid is None else number(rid, len(canon))

        for command, targets, _ in commands:
            if type(command) is tuple:  # a tensor op (most commands), inline: ~2x faster
                _, result, op, reads, stream, scalars = command
                read = tuple([number(r, len(canon)) for r in reads])
                if type(result) is tuple:
                    made.update(result)
                    made_here = tuple([number(r, len(canon)) for r in result])
                else:
                    made.add(result)
                    made_here = (number(result, len(canon)),)
                if skeleton is not None:
                    floats.extend(scalars)
                    skeleton.append(("op", targets, stream, op, read, made_here, len(scalars)))
                continue
            result, reads, stream = fields(command)
            read = tuple([c(r) for r in reads])
            made.update(results_of(result))
            if skeleton is None:
                for r in results_of(result):
                    c(r)
                continue
            try:
                skeleton.append(_message_skeleton(command, targets, c))
            except Exception:
                skeleton = None
        self.skeleton = None if skeleton is None else tuple(skeleton)
        self.floats = tuple(floats)
        self.ids = list(canon)
        self.made = made
        self.whats = [what for _, _, what in commands]

    def same_as(self, other: Signature, floats: bool = True) -> bool:
        """The same commands (and, with ``floats``, the same lifted floats)."""
        try:
            return (
                self.skeleton is not None
                and bool(self.skeleton == other.skeleton)
                and (not floats or bool(self.floats == other.floats))
            )
        except Exception:  # arguments that do not compare (tensors sent by value)
            return False

    def difference(self, other: Signature) -> str:
        """Where ``other`` (a later call) did something else, in words."""
        if self.skeleton is None or other.skeleton is None:
            return "an argument sent by value cannot be compared between calls"
        for i, (a, b) in enumerate(zip(self.skeleton, other.skeleton)):
            if _differ(a, b):
                return f"command {i + 1} ({other.whats[i] or a[0]}) differs: {_field_apart(a, b)}"
        if len(self.skeleton) != len(other.skeleton):
            return f"one call sent {len(self.skeleton)} commands, the next {len(other.skeleton)}"
        for a, b in zip(self.floats, other.floats):
            if _differ(a, b):
                return f"a float argument changes per call ({a!r}, then {b!r})"
        return "the tensors it reads do not outlive a call"


def _message_skeleton(msg, targets, c) -> tuple:
    values = msg._asdict()
    values.pop("ident", None)
    for name in _ID_FIELDS & values.keys():
        values[name] = c(values[name])
    if type(msg).__name__ == "CallFunction":
        values["args"] = _comparable(unpack_args(msg.args, lambda rid: ("ref", c(rid))))
    return (type(msg).__name__, targets, tuple(values.items()))


def _comparable(obj):
    """``obj`` with each tensor sent by value (a host scalar beside mesh tensors) as
    its dtype, shape and bytes: two calls that sent the same values compare equal."""
    t = type(obj)
    if t in (tuple, list):
        return t(_comparable(o) for o in obj)
    if t is dict:
        return {k: _comparable(v) for k, v in obj.items()}
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        data = obj.detach().reshape(-1).clone().view(torch.uint8).numpy().tobytes()
        return ("tensor", obj.dtype, tuple(obj.shape), data)
    return obj


def _differ(a, b) -> bool:
    try:
        return bool(a != b)
    except Exception:  # values that do not compare
        return True


def _field_apart(a: tuple, b: tuple) -> str:
    if a[0] != b[0]:
        return f"a {a[0]} command, then a {b[0]}"
    if a[0] == "op":
        names = ("kind", "ranks", "stream", "op (its non-float arguments or layouts)", "inputs")
        for name, x, y in zip(names, a, b):
            if _differ(x, y):
                return f"its {name} changed between calls"
        return "it reads or makes other values"
    return "its arguments changed between calls (a Python value computed per call?)"
