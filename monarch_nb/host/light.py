"""A light rank (``monarch-nb-host --simulate N``): the worker protocol's control
path without torch, so that the controller's cost at 1,024 ranks can be measured
on one machine.

A light rank joins as a worker does (WorkerReady, then Health and Progress), through
its host's one signed socket (``fanout.HostChannel``): the host verifies each command
once and hands it to every rank it names. Commands run at once, in arrival order, on
the agent's one thread: a stream's ``Status`` always comes after what was sent before
it. What needs torch (collectives, tensors, pdb,
pipes, recordings) fails with a clear error naming simulate mode.
"""

from __future__ import annotations

import ast
import builtins
import os
import sys
import time
import traceback

from ..protocol import messages as m
from ..protocol.receivers import WORKER, handler_table
from ..protocol.wire import encode_result, resolve_function, unpack_args

PROGRESS_PERIOD = 0.1
HEALTH_PERIOD = 1.0
# messages that need torch or a real process: refused, naming simulate mode
REFUSED = (
    "Reduce SendTensor RunOps RunCell PostMortem PipeRecv CallRecording BorrowCreate "
    "DefineOp CreateProcessGroup CreatePipe ClosePipe DefineRecording DebuggerMessage "
    "BorrowFirstUse BorrowDrop DeleteRecording SyncFiles"
).split()
_REPLIES = {"RunCell", "PostMortem"}  # their caller waits for a FetchResult too


class Failed:
    """The value of a command that failed (its ``ident``): what reads it fails too."""

    __slots__ = ("ident",)

    def __init__(self, ident: int):
        self.ident = ident


class _Dependent(Exception):
    def __init__(self, ident: int):
        super().__init__(f"depends on failed command {ident}")
        self.ident = ident


class LightRank:
    """One simulated rank of ``world`` joining ``address``; ``host`` names its
    simulated host in what it reports."""

    def __init__(self, channel, rank: int, world: int, host: str):
        self.rank, self.world, self.host = rank, world, host
        self.channel = channel
        self.signer = channel.signer
        self.peers = channel.peers
        self.env: dict = {}  # ref id -> value (or Failed)
        self.namespace: dict = {"__name__": "__main__", "__builtins__": builtins}
        self.streams: dict[int, list] = {0: [0, 0, 0]}  # id -> [started, finished, done]
        self.stream_names: dict[int, str] = {0: "default"}
        self.known: dict = {}  # what the controller was last told of progress
        self.ended: int | None = None  # the exit code once it stops serving
        self.note = ""  # why it ended, for the controller's tail
        self.next_progress = 0.0
        self.next_health = 0.0
        self._handlers = handler_table(
            self, WORKER, prefix="on_", refused=REFUSED, refuse=self._refuse_message
        )
        self._send(
            m.WorkerReady(
                rank,
                world,
                os.getpid(),
                host,
                False,
                {"python": sys.version.split()[0], "torch": None, "simulated": True},
            )
        )

    # ------------------------------------------------------------ wire

    def _send(self, msg) -> None:
        if self.ended is None:
            self.channel.post(msg)

    def handle(self, msg) -> None:
        handler = self._handlers.get(type(msg))
        if handler is None:
            self.peers.count("malformed")
        else:
            handler(msg)

    def _refuse_message(self, msg) -> None:
        self._refuse(msg, type(msg).__name__)

    def tick(self, now: float, rss: int, cpu: float) -> None:
        """Progress when it changed (not more often than PROGRESS_PERIOD), Health
        every HEALTH_PERIOD (``rss``, ``cpu``: the simulated host's, per rank)."""
        if now >= self.next_progress:
            self.next_progress = now + PROGRESS_PERIOD
            progress = {sid: tuple(v) for sid, v in self.streams.items()}
            if progress != self.known:
                self.known = progress
                self._send(m.Progress(self.rank, progress))
        if now >= self.next_health:
            self.next_health = now + HEALTH_PERIOD
            rej = dict(self.peers.rejections)
            bad = sum(rej.values())
            self._send(m.Health(self.rank, os.getpid(), rss, cpu, None, bad, len(self.env), rej))

    def stop(self, code: int, note: str = "") -> None:
        """Stop serving (Exit: 0); the agent reports the end. Nothing more is sent."""
        if self.ended is None:
            self.ended, self.note = code, note

    # ------------------------------------------------------------ commands

    def _run(self, ident: int, sid: int, work, result: int | None = None, report=True):
        """Run ``work`` as command ``ident`` of stream ``sid``; its value goes to
        ``result``, its failure to ``result`` and (``report``) to the controller.
        Returns (value, failure)."""
        s = self.streams.get(sid)
        if s is None:
            s = self.streams[sid] = [0, 0, 0]
        s[0] = ident
        value = failure = None
        try:
            value = work()
        except _Dependent as e:
            failure = m.DependentOn(e.ident)
            value = Failed(e.ident)
        except BaseException as e:  # noqa: B036 - user code failed: reported, never raised here
            failure = describe(e)
            value = Failed(ident)
            if report:
                self._send(m.RemoteFunctionFailed(ident, self.rank, sid, failure))
        for r in result if type(result) is tuple else () if result is None else (result,):
            self.env[r] = value
        s[1] = ident
        s[2] += 1
        return value, failure

    def _resolve(self, rid: int):
        v = self.env.get(rid, _MISSING)
        if v is _MISSING:
            raise KeyError(f"Ref {rid} is not defined on simulated rank {self.rank} (deleted?)")
        if type(v) is Failed:
            raise _Dependent(v.ident)
        return v

    def _refuse(self, msg, name: str) -> None:
        if name == "RunOps":  # each tensor op in it fails as a command of its own
            for ident, result, _, _, sid, _ in msg.ops:
                self._refuse_command(ident, sid, result, name)
            return
        ident = getattr(msg, "ident", None)
        if ident is None:  # a setup message (a group, a pipe): its first use says why
            return
        failure = self._refuse_command(
            ident, getattr(msg, "stream", 0), getattr(msg, "result", None), name
        )
        if name in _REPLIES:
            self._send(m.FetchResult(ident, self.rank, None, failure))

    def _refuse_command(self, ident: int, sid: int, result, name: str):
        """Command ``ident`` fails, naming simulate mode; returns its failure."""
        why = (
            f"a simulated light rank (monarch-nb-host --simulate): {name} needs torch or a "
            f"real worker process (collectives, "
            f"tensors, pdb, pipes and recordings are not simulated)"
        )

        def refuse():
            raise NotImplementedError(why)

        return self._run(ident, sid, refuse, result)[1]

    def on_CreateDeviceMesh(self, msg: m.CreateDeviceMesh) -> None:
        coords = msg.ranks.coordinates(self.rank)
        if msg.result == 0 and coords is not None:
            named = dict(zip(msg.names, coords))
            self.namespace.update(rank=self.rank, size=len(msg.ranks), **named)

    def on_InitBackend(self, msg: m.InitBackend) -> None:
        # no torch.distributed: the control path only
        self._send(m.FetchResult(msg.ident, self.rank, None, None))

    def on_CreateStream(self, msg: m.CreateStream) -> None:
        self.streams.setdefault(msg.result, [0, 0, 0])
        self.stream_names[msg.result] = msg.name

    def on_CallFunction(self, msg: m.CallFunction) -> None:
        def work():
            fn = resolve_function(msg.function)
            a, kw = unpack_args(msg.args, self._resolve)
            return fn(*a, **kw)

        self._run(msg.ident, msg.stream, work, msg.result)

    def on_RunCode(self, msg: m.RunCode) -> None:
        ns = self.namespace
        self._run(
            msg.ident, msg.stream, lambda: run_source(msg.source, msg.filename, ns), msg.result
        )

    def on_WidgetEvent(self, msg: m.WidgetEvent) -> None:
        pass  # a light rank runs no cells, so it has no widgets

    def on_SetNames(self, msg: m.SetNames) -> None:
        self._run(
            msg.ident,
            msg.stream,
            lambda: self.namespace.update(unpack_args(msg.args, self._resolve)[1]),
        )

    def on_SendValue(self, msg: m.SendValue) -> None:
        def work():
            a, kw = unpack_args(msg.args, self._resolve)
            return a[0] if msg.function is None else resolve_function(msg.function)(*a, **kw)

        value, failure = self._run(msg.ident, msg.stream, work, report=False)
        self._reply(msg.ident, None if failure else value, failure)

    def on_Pull(self, msg: m.Pull) -> None:
        def work():
            if msg.name not in self.namespace:
                raise NameError(f"name {msg.name!r} is not defined on rank {self.rank}")
            return self.namespace[msg.name]

        value, failure = self._run(msg.ident, msg.stream, work, report=False)
        self._reply(msg.ident, None if failure else value, failure)

    def _reply(self, ident: int, value, failure) -> None:
        frames = encode_result(ident, self.rank, value, failure, self.signer)
        if self.ended is None:
            self.channel.post(frames)  # encoded: the channel sends it as it is

    def on_RequestStatus(self, msg: m.RequestStatus) -> None:
        for sid, (started, finished, done) in self.streams.items():
            self._send(m.Status(self.rank, sid, msg.ident, (started, finished, done)))
        self.known = {sid: tuple(v) for sid, v in self.streams.items()}

    def on_RequestStacks(self, msg: m.RequestStacks) -> None:
        stacks = {n: {"running": None, "stack": ""} for n in self.stream_names.values()}
        self._send(m.FetchResult(msg.ident, self.rank, stacks, None))

    def on_ReadClock(self, msg: m.ReadClock) -> None:
        self._send(m.FetchResult(msg.ident, self.rank, time.time(), None))

    def on_ReadMemory(self, msg) -> None:  # and the profiler's: a light rank has no torch
        # no rank in the text: the failures of every rank fold into one (a 1,024-rank mesh)
        why = f"a simulated light rank: {type(msg).__name__} needs torch"
        failure = m.RemoteFailure("NotImplementedError", why, "")
        self._send(m.FetchResult(msg.ident, self.rank, None, failure))

    on_StartProfile = on_StopProfile = on_ReadMemory

    def on_Complete(self, msg) -> None:  # and Inspect: a light rank has no IPython shell
        why = "a simulated light rank: it has no IPython shell"
        failure = m.RemoteFailure("NotImplementedError", why, "")
        self._send(m.FetchResult(msg.ident, self.rank, None, failure))

    on_Inspect = on_Complete

    def on_ForgetDefinitions(self, msg: m.ForgetDefinitions) -> None:
        pass  # a light rank defines no tensor ops or recordings

    def on_DeleteRefs(self, msg: m.DeleteRefs) -> None:
        for rid in msg.refs:
            self.env.pop(rid, None)

    def on_CommandGroup(self, msg: m.CommandGroup) -> None:
        for c in msg.commands:
            self.handle(c)

    def on_Interrupt(self, msg: m.Interrupt) -> None:
        pass  # commands run to their end as they arrive: nothing runs between messages

    def on_Cancel(self, msg: m.Cancel) -> None:
        pass  # likewise: nothing waits to start

    def on_ReleaseFailures(self, msg: m.ReleaseFailures) -> None:
        pass  # no failure is kept for post-mortem here

    def on_Ping(self, msg: m.Ping) -> None:
        pass

    def on_Refused(self, msg: m.Refused) -> None:
        self.stop(2, f"the controller refused simulated rank {self.rank}: {msg.reason}")

    def on_Exit(self, msg: m.Exit) -> None:
        progress = {sid: tuple(v) for sid, v in self.streams.items()}
        if progress != self.known:
            self._send(m.Progress(self.rank, progress))
        self.stop(0)


_MISSING = object()


def run_source(source: str, filename: str, namespace: dict):
    """Execute ``source`` in ``namespace``; the value of a trailing expression."""
    tree = ast.parse(source, filename, "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    if tree.body:
        exec(compile(tree, filename, "exec"), namespace)
    return None if last is None else eval(compile(last, filename, "eval"), namespace)


def describe(e: BaseException) -> m.RemoteFailure:
    """``e`` as the controller receives a worker's failure (without this module's frames)."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename != __file__]
    text = "Traceback (most recent call last):\n" + "".join(traceback.format_list(frames))
    text += "".join(traceback.format_exception_only(type(e), e))
    t = type(e)
    try:
        message = str(e)
    except Exception:
        message = "<unprintable exception>"
    return m.RemoteFailure(t.__name__, message, text, t.__module__, t.__qualname__)
