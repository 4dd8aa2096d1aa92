"""JupyterLab's debugger sees the workers: paused remote pdb sessions as DAP threads.

``install(kernel)`` wraps the kernel's ipykernel Debugger ``process_request``.
``threads`` gets one thread per paused (rank, stream) session of every mesh,
named ``rank R · STREAM``; a request naming one of those threads (or a frame or
variable reference handed out for one) is answered here from the worker's pdb
(controller DebugSessions.inspect and pdb lines); every other request goes to
ipykernel (and debugpy) unchanged. Our ids start at ``THREAD_BASE`` and
``REF_BASE``, far above the small integers debugpy counts from.

When a session pauses, runs on or ends while the debugger is on, ``stopped``,
``continued`` and ``thread`` (exited) events go out on IOPub as ``debug_event``.
Gutter breakpoints: dap_breakpoints.py; sources of remote frames: dap_sources.py;
what debugpy leaves alone: dap_debugpy.py (docs/debugger.md).
"""

from __future__ import annotations

import itertools
import threading

from ..api import context
from . import dap_debugpy, dap_sources
from .dap_breakpoints import Breakpoints, set_breakpoints
from .dap_wire import DapError, off_loop, response, to_int

THREAD_BASE = 1 << 30
REF_BASE = 1 << 31
TIMEOUT = 10.0  # seconds a worker has to answer one request
_STEPS = {"continue": "c", "next": "n", "stepIn": "s", "stepOut": "stepout"}
_THREAD_CMDS = {"stackTrace", "pause", *_STEPS}


class DebuggerPanel:
    """Whether JupyterLab's debugger is attached (its panel then serves paused ranks)."""

    attached = False


PANEL = DebuggerPanel()


class RemoteThreads:
    """The DAP adapter for remote threads, between JupyterLab and ipykernel's Debugger."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.debugger = kernel.debugger
        self.orig_request = self.debugger.process_request  # ipykernel's own
        self._lock = threading.Lock()
        self._tids: dict[tuple, int] = {}  # (id(sessions), rank, stream) -> thread id
        self._next_tid = itertools.count(THREAD_BASE + 1)
        self._next_ref = itertools.count(REF_BASE + 1)
        self._refs: dict[int, tuple] = {}  # our id -> (key, "frame"|"var", worker index/ref)
        self._live: dict[tuple, tuple] = {}  # key -> (DebugSessions, Session) of paused ones
        self._watched: dict[int, object] = {}  # id(DebugSessions) -> it (listener added)
        self._seq = itertools.count(1)
        self._mesh_names: dict[int, str] = {}  # id(DebugSessions) -> its mesh's name
        self._continued: set = set()  # keys continued from the panel, until they run
        self._shown: int | None = None  # the thread of our last stopped event
        self._told_stopped: set[int] = set()  # threads whose last event was "stopped"
        self.breakpoints = Breakpoints()
        self.sources = dap_sources.Sources(kernel)
        self.debugger.process_request = self.process_request

    # ------------------------------------------------------------ sessions

    def watch(self) -> None:
        """Listen to every mesh's debugger sessions (meshes come and go)."""
        if getattr(self.debugger, "is_started", False):
            dap_debugpy.keep_threads_running()  # a new mesh's IO thread too
        for mesh in list(context.all_meshes().values()):
            try:
                dbg = mesh.debugger
            except Exception:
                continue
            self._mesh_names[id(dbg)] = mesh.name
            if id(dbg) in self._watched:
                continue
            self._watched[id(dbg)] = dbg
            dbg.listeners.append(lambda event, s, dbg=dbg: self.on_event(dbg, event, s))
            for s in dbg.sessions():
                if s.announced:
                    self._remember(dbg, s)

    def _key(self, dbg, s) -> tuple:
        return (id(dbg), s.rank, s.stream)

    def _remember(self, dbg, s) -> int:
        key = self._key(dbg, s)
        with self._lock:
            self._live[key] = (dbg, s)
            tid = self._tids.get(key)
            if tid is None:
                tid = self._tids[key] = next(self._next_tid)
            return tid

    def _forget_refs(self, key) -> None:
        with self._lock:
            for ref in [r for r, v in self._refs.items() if v[0] == key]:
                del self._refs[ref]

    def on_event(self, dbg, event: str, s) -> None:
        """A DebugSessions listener (the controller's IO thread)."""
        key = self._key(dbg, s)
        if event in ("paused", "repaused"):
            tid = self._remember(dbg, s)
            reason = s.reason if event == "repaused" or s.reason == "pause" else "breakpoint"
            self._emit(
                "stopped",
                threadId=tid,
                reason=reason,
                allThreadsStopped=False,
                description=f"rank {s.rank} · {s.stream_name} paused",
            )
            return
        self._forget_refs(key)
        with self._lock:
            tid = self._tids.get(key)
            if event == "resumed":
                self._live.pop(key, None)
        if tid is None:
            return
        if tid in self._told_stopped:  # once: JupyterLab clears its panel on each
            self._told_stopped.discard(tid)
            self._emit("continued", threadId=tid, allThreadsContinued=False)
        if event == "resumed":
            self._emit("thread", reason="exited", threadId=tid)
        with self._lock:
            continued = key in self._continued
            self._continued.discard(key)
        if continued:
            self._show_next(key)

    def _show_next(self, gone) -> None:
        """JupyterLab shows the frames of the thread that stopped last only: when the
        one it showed is continued, the next paused rank is announced again."""
        with self._lock:
            waiting = sorted(
                (tid, self._live[key][1])
                for key, tid in self._tids.items()
                if key != gone and key in self._live and self._live[key][1].prompt is not None
            )
        if waiting:
            tid, s = waiting[0]
            self._emit(
                "stopped",
                threadId=tid,
                reason=s.reason if s.reason in ("pause", "step") else "breakpoint",
                allThreadsStopped=False,
                description=f"rank {s.rank} · {s.stream_name} still paused",
            )

    def _emit(self, event: str, **body) -> None:
        if not getattr(self.debugger, "is_started", False):
            return
        if event == "stopped":
            self._shown = body["threadId"]
            self._told_stopped.add(body["threadId"])
        msg = {"seq": next(self._seq), "type": "event", "event": event, "body": body}
        try:
            self.kernel._publish_debug_event(msg)
        except Exception:
            pass

    def threads(self) -> list[dict]:
        with self._lock:
            live = sorted(self._live.items(), key=lambda kv: self._tids[kv[0]])
        live = [(key, dbg, s) for key, (dbg, s) in live if not s.ended and dbg.worker_alive(s)]
        several = len({key[0] for key, _, _ in live}) > 1  # then the name says the mesh
        return [{"id": self._tids[key], "name": self._name(key, s, several)} for key, _, s in live]

    def _name(self, key, s, several: bool) -> str:
        name = f"rank {s.rank} · {s.stream_name}"
        return f"{name} · {self._mesh_names.get(key[0], '?')}" if several else name

    def _thread(self, tid) -> tuple:
        with self._lock:
            key = next((k for k, t in self._tids.items() if t == tid), None)
            dbg_s = self._live.get(key) if key is not None else None
        if dbg_s is None or dbg_s[1].ended or not dbg_s[0].worker_alive(dbg_s[1]):
            raise DapError(
                f"no paused worker session has thread id {tid} "
                "(it continued, or its worker is gone)"
            )
        return key, dbg_s

    def _ref(self, ref, kind: str) -> tuple:
        with self._lock:
            found = self._refs.get(ref)
        if found is None or found[1] != kind:
            raise DapError(f"no {kind} {ref} on a paused worker (the thread ran on since)")
        key, _, index = found
        with self._lock:
            dbg_s = self._live.get(key)
        if dbg_s is None or dbg_s[1].ended:
            raise DapError(f"the worker session of {kind} {ref} has ended")
        return key, dbg_s, index

    def _new_ref(self, key, kind: str, index: int) -> int:
        with self._lock:
            ref = next(self._next_ref)
            self._refs[ref] = (key, kind, index)
            return ref

    # ------------------------------------------------------------ requests

    def ours(self, command: str, args: dict) -> bool:
        if command in _THREAD_CMDS:
            return to_int(args.get("threadId")) >= THREAD_BASE
        if command in ("scopes", "evaluate"):
            return to_int(args.get("frameId")) >= REF_BASE
        if command == "variables":
            return to_int(args.get("variablesReference")) >= REF_BASE
        return False

    def before_cell(self, *_info) -> None:
        """IPython's pre_run_cell: with the debugger on (maybe since before monarch_nb was
        loaded), a mesh this cell starts must come up as without it."""
        if getattr(self.debugger, "is_started", False):
            dap_debugpy.keep_workers_plain()

    def _remote_shown(self) -> bool:
        """A remote thread is paused and the kernel itself is not stopped in debugpy."""
        return not getattr(self.debugger, "stopped_threads", None) and bool(self.threads())

    def _panel_means_shown(self, args: dict) -> bool:
        """JupyterLab's continue button forgets the thread it shows before it sends
        the request, which then names thread 1. With the kernel itself not stopped
        in debugpy, it means the remote thread the panel shows: the last stopped."""
        if to_int(args.get("threadId")) >= THREAD_BASE or self._shown is None:
            return False
        return self._remote_shown() and self._shown in {t["id"] for t in self.threads()}

    def answer(self, command: str, args: dict) -> dict:
        """The body of our answer (blocking: worker round trips); DapError for bad input."""
        if command == "pause":
            try:
                self._thread(args["threadId"])
            except DapError:
                raise DapError(
                    f"thread id {args['threadId']} cannot be paused: its rank runs without a "
                    "debugger session (only a rank that stopped and still traces, with a "
                    "breakpoint set, can be; or put breakpoint() in its code)"
                ) from None
        if command in _THREAD_CMDS:
            key, (dbg, s) = self._thread(args["threadId"])
            if command == "stackTrace":
                return self._stack(key, dbg, s, args)
            if command == "pause":
                return self._pause(dbg, s)
            self._forget_refs(key)
            if command == "continue":
                with self._lock:
                    self._continued.add(key)
            try:
                dbg.send(s, _STEPS[command])
            except KeyError as e:
                raise DapError(str(e)) from None
            return {"allThreadsContinued": False} if command == "continue" else {}
        if command == "scopes":
            key, (dbg, s), index = self._ref(args["frameId"], "frame")
            body = self._ask(dbg, s, "scopes", {"frame": index})
            for sc in body["scopes"]:
                sc["variablesReference"] = self._new_ref(key, "var", sc["variablesReference"])
                sc["expensive"] = False
            return body
        if command == "variables":
            key, (dbg, s), ref = self._ref(args["variablesReference"], "var")
            q = {"ref": ref, "start": args.get("start"), "count": args.get("count")}
            body = self._ask(dbg, s, "variables", q)
            for v in body["variables"]:
                self._localise(key, v)
            return body
        key, (dbg, s), index = self._ref(args["frameId"], "frame")
        q = {"frame": index, "expression": args.get("expression", "")}
        return self._localise(key, self._ask(dbg, s, "evaluate", q))

    def _pause(self, dbg, s) -> dict:
        if s.prompt is not None:  # paused already
            return {}
        try:
            dbg.pause(s)  # it runs under its pdb (or is leaving its prompt): stops at its next line
        except KeyError as e:
            raise DapError(str(e)) from None
        return {}

    def _localise(self, key, v: dict) -> dict:
        if v.get("variablesReference"):
            v["variablesReference"] = self._new_ref(key, "var", v["variablesReference"])
        return v

    def _ask(self, dbg, s, command: str, args: dict) -> dict:
        try:
            return dbg.inspect(s, command, args, TIMEOUT)
        except (LookupError, TimeoutError, ValueError) as e:
            raise DapError(f"rank {s.rank}: {e}") from None

    def _stack(self, key, dbg, s, args: dict) -> dict:
        frames = self._ask(dbg, s, "stack", {})["frames"]
        start = max(0, to_int(args.get("startFrame")))
        levels = to_int(args.get("levels"))
        levels = levels if levels > 0 else len(frames)
        out = []
        for f in frames[start : start + levels]:
            out.append(
                {
                    "id": self._new_ref(key, "frame", f["index"]),
                    "name": f"{f['name']} · rank {s.rank}",  # JupyterLab shows no thread name
                    "line": f["line"] or 0,
                    "column": 1,
                    "source": self.sources.of_frame(f["file"], key),
                }
            )
        return {"stackFrames": out, "totalFrames": len(frames)}

    async def process_request(self, message: dict) -> dict:
        command = message.get("command")
        args = message.get("arguments") or {}
        try:
            self.watch()
        except Exception:  # never in the way of the kernel's own debugging
            pass
        if command == "setBreakpoints":
            return await set_breakpoints(self, message, args)
        if command == "source":
            return await self._source(message, args)
        if command == "inspectVariables" and self._remote_shown():
            # JupyterLab asks for the kernel's globals whenever output comes while it
            # sees no stopped thread, as between a continue and the next rank shown;
            # a late answer would replace the shown rank's variables
            return response(message, error="a paused worker thread is shown")
        if command == "continue" and self._panel_means_shown(args):
            args = {**args, "threadId": self._shown}
        if self.ours(command, args):
            try:
                body = await off_loop(self.answer, command, args)
            except DapError as e:
                return response(message, error=str(e))
            except Exception as e:  # bad arguments: a clear answer, never a hang
                return response(message, error=f"{command}: {type(e).__name__}: {e}")
            return response(message, body)
        reply = await self.orig_request(message)
        if command in ("initialize", "attach"):
            dap_debugpy.keep_workers_plain()
            dap_debugpy.keep_threads_running()
            PANEL.attached = command == "attach" or PANEL.attached
        if command == "threads":
            reply = reply or response(message, {"threads": []})
            reply.setdefault("body", {}).setdefault("threads", []).extend(self.threads())
        elif command == "debugInfo" and reply:
            stopped = reply.setdefault("body", {}).setdefault("stoppedThreads", [])
            stopped.extend(t["id"] for t in self.threads())
        elif command == "disconnect":
            self.breakpoints.clear()
            PANEL.attached = False
        return reply

    async def _source(self, message: dict, args: dict) -> dict:
        path = (args.get("source") or {}).get("path") or ""
        if not self.sources.remote(path):
            return await self.orig_request(message)
        try:
            content = await off_loop(self.sources.content, path, self._ask_source)
        except DapError as e:
            return response(message, error=str(e))
        return response(message, {"content": content})

    def _ask_source(self, key, path: str) -> str:
        with self._lock:
            dbg_s = self._live.get(key)
        if dbg_s is None or dbg_s[1].ended:
            raise DapError(f"source of {path} is not available on the kernel's host")
        try:
            return dbg_s[0].inspect(dbg_s[1], "source", {"path": path}, TIMEOUT)["content"]
        except (LookupError, TimeoutError, ValueError):
            raise DapError(f"source of {path} is not available on the kernel's host") from None


def install(kernel) -> RemoteThreads | None:
    """Put the adapter in front of ``kernel.debugger`` (once); None without one (no debugpy)."""
    if getattr(kernel, "debugger", None) is None:
        return None
    adapter = getattr(kernel, "_monarch_dap", None)
    if adapter is None:
        adapter = kernel._monarch_dap = RemoteThreads(kernel)
        shell = getattr(kernel, "shell", None)
        if shell is not None:
            shell.events.register("pre_run_cell", adapter.breakpoints.before_cell)
            shell.events.register("pre_run_cell", adapter.before_cell)
    return adapter


__all__ = ["REF_BASE", "THREAD_BASE", "DapError", "RemoteThreads", "install"]
