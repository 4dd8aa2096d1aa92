"""The bad-input catalogue: a table of bad inputs across the Python API, user code on
the workers and the magics, each with the exact error it must give (exception
type, not a subclass, and message). After every entry the same mesh computes
correctly and holds no unreported failure; after the whole table too.

Real parts only: a dp=2 mesh and a dp=1 mesh of real worker processes, and the
real magics in an in-process IPython shell (no kernel needed to call them).
Sizes: the 1 GB print runs in full (about 5 s here); the 2 GB argument runs at
256 MB in CI and in full under ``@pytest.mark.slow`` (``python -m pytest -m slow
tests/reliability``: 10 s, 6 GB of memory over the three processes).
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from IPython.core.error import UsageError
from reliability_helpers import Collect, PeakRss, wait_for, wait_running

import monarch_nb as mnb
from monarch_nb.notebook.results import CellSyntaxError, RemoteCellError

MESH = "rel"
OTHER = "rel-b"


def add(a, b):
    return a + b


def rank_value():
    return torch.full((2,), float(mnb.current_rank() + 1))


def lock_value():
    return threading.Lock()


def deep_list(depth: int = 100_000):
    x: list = []
    for _ in range(depth):
        x = [x]
    return x


class BadReduce:
    def __reduce__(self):
        raise ValueError("no pickling today")


class ImportsNothing:
    """Pickles fine here; unpickling it imports a module nobody has."""

    def __reduce__(self):
        return (__import__, ("no_such_module_anywhere",))


def bad_reduce_value():
    return BadReduce()


def _cancel_twice(mesh):
    """A fetch queued behind a sleep, cancelled twice: True, then False; cancelled."""
    mnb.remote(time.sleep)(30, mesh=mesh)
    result = mnb.remote(add)(1, 2, mesh=mesh).fetch_async()
    return (result.cancel(), result.cancel(), result.cancelled())


def _interrupt_quietly(mesh):
    mesh.interrupt()
    try:
        mesh.wait(timeout=30)
    except mnb.RemoteError:  # the interrupted sleep
        pass


def raise_with_broken_str():
    class Broken(Exception):
        def __str__(self):
            raise RuntimeError("str failed")

    raise Broken()


class NeedsArgs(Exception):
    """An exception whose __init__ needs arguments (the controller must not call it)."""

    def __init__(self, path, line):
        super().__init__(f"{path}:{line}: bad record")
        self.path, self.line = path, line


class OwnNew(Exception):
    """An exception with its own __new__: not combined with RemoteError."""

    def __new__(cls, code):
        return super().__new__(cls, code)


def raise_needs_args():
    raise NeedsArgs("data.csv", 7)


def raise_own_new():
    raise OwnNew(5)


def _type_only_on_workers(ctx):
    src = (
        "import sys, types\n"
        "mod = types.ModuleType('errors_only_on_workers')\n"
        "sys.modules['errors_only_on_workers'] = mod\n"
        "exec('class Gone(Exception):\\n    pass', mod.__dict__)\n"
        "mod.Gone.__module__ = 'errors_only_on_workers'\n"
        "raise mod.Gone('from a module the controller lacks')"
    )
    return ctx.mesh.exec(src).fetch(timeout=30)


def recurse(n=0):
    return recurse(n + 1)


def shaped(n):
    return torch.zeros(n + mnb.current_rank())


def lonely_breakpoint_allreduce(group):
    """Rank 0 pauses in pdb before the collective; rank 1 waits inside it."""
    import torch.distributed as dist

    t = torch.ones(2) * (mnb.current_rank() + 1)
    if mnb.current_rank() == 0:
        breakpoint()
    dist.all_reduce(t, group=group)
    return t


class Ctx:
    def __init__(self, mesh, other, stale, shell):
        self.mesh = mesh
        self.other = other
        self.stale = stale  # a Ref of OTHER from before its restart
        self.shell = shell
        self.ctrl = mesh._controller

    def ref(self, fn=rank_value, *args, **kw):
        return mnb.remote(fn)(*args, mesh=self.mesh, **kw)

    def deleted(self):
        r = self.ref()
        r.delete()
        return r

    def line(self, line: str):
        return self.shell.run_line_magic("monarch_mesh", line)

    def cell(self, line: str, body: str):
        return self.shell.run_cell_magic("monarch", line, body)


@dataclass
class Bad:
    id: str
    action: Callable[[Ctx], Any]
    raises: type | None  # the exact exception type; None: the action must succeed
    match: str = ""  # regex searched in str(error)
    check: Callable | None = None  # check(error or result, ctx)
    after: Callable | None = None  # recovery the entry needs (a restart)
    remote: type | None = None  # the remote exception's type, which the RemoteError also is


def failed_with(etype, message=None, ranks=(0, 1)):
    """A RemoteError check: every rank in ``ranks`` failed with ``etype`` (and ``message``)."""

    def check(e, ctx):
        assert sorted(e.failures) == sorted(ranks), e.failures
        for r in ranks:
            got_type, got_msg, _ = e.failures[r]
            assert got_type == etype, e.failures[r]
            if message is not None:
                assert re.search(message, got_msg), (message, got_msg)

    return check


def output_check(rank_text: dict, *, timeout=10.0):
    """Run the action with output collected; check each rank's text."""

    def action_wrapper(action):
        def run(ctx):
            with Collect(ctx.mesh) as out:
                result = action(ctx)
                wait_for(
                    lambda: all(t in out.of(r) for r, t in rank_text.items()),
                    timeout,
                    f"output {rank_text}",
                )
            return result, out

        return run

    return action_wrapper


def _fetch_during_shutdown(ctx):
    """A fetch asked for while the mesh shuts down fails at once; one asked for
    before fails too, naming the shutdown (what runs is interrupted)."""
    slow = mnb.remote(time.sleep)(2, mesh=ctx.other)
    ctx.pending = slow.fetch_async()
    ctx.stopping = threading.Thread(target=ctx.other.shutdown)
    ctx.stopping.start()
    wait_for(lambda: ctx.other._controller._closing, 10, "the shutdown to begin")
    return slow.fetch(timeout=30)


def _after_shutdown(ctx):
    ctx.stopping.join(30)
    with pytest.raises(mnb.MeshClosedError, match=f"^mesh '{OTHER}' was shut down$"):
        ctx.pending.result(timeout=30)
    assert ctx.other.closed


def _breakpoint_in_collective(ctx):
    r = mnb.remote(lonely_breakpoint_allreduce)(ctx.mesh.process_group("dp"), mesh=ctx.mesh)
    dbg = ctx.mesh.debugger
    try:
        assert dbg.wait_any(30), "rank 0 did not pause"
        # rank 1 sits in the collective meanwhile; its worker still answers
        wait_running(ctx.mesh, [1], what="lonely_breakpoint_allreduce")
        assert [s.rank for s in dbg.sessions()] == [0]
        assert dbg.run(0, "p t.tolist()").startswith("[1.0, 1.0]")
    finally:
        dbg.continue_all()
    return r.fetch(timeout=60)


def _big_argument(nbytes):
    def action(ctx):
        t = torch.ones(nbytes // 4)
        got = mnb.remote(lambda x: (x.numel(), float(x[-1])))(t, mesh=ctx.mesh).fetch(timeout=600)
        return got

    return action


def _big_print(nbytes):
    """One rank prints ``nbytes`` of text; every byte reaches the controller and
    neither process grows by more than a bounded amount beyond the text itself."""

    def action(ctx):
        pids = [os.getpid(), ctx.ctrl.worker_pids()[0]]
        with Collect(ctx.mesh) as out, PeakRss(pids) as rss:
            out.keep = False
            ctx.mesh.exec(f"if rank == 0:\n    s = 'x' * {nbytes}\n    print(s)\n    del s").fetch(
                timeout=600
            )
            wait_for(lambda: out.nbytes >= nbytes + 1, 60, "all the output")
        return out.nbytes, rss.growth(pids[0]), rss.growth(pids[1]) - nbytes

    return action


def _check_big_print(nbytes):
    def check(res, ctx):
        got, ctrl_growth, worker_extra = res
        assert got == nbytes + 1
        # bounded by the flow control (256 messages of 64 KB each way), not by the text
        assert ctrl_growth < 96 << 20, f"controller grew {ctrl_growth >> 20} MB"
        assert worker_extra < 96 << 20, f"worker grew {worker_extra >> 20} MB beyond the text"

    return check


def _os_exit(ctx):
    return ctx.mesh.exec("import os\nif rank == 1:\n    os._exit(0)\nrank").fetch(timeout=30)


def _restart(ctx):
    ctx.mesh.restart()


def _unloadable_on_controller(ctx):
    src = (
        "import sys, types\n"
        "mod = types.ModuleType('only_on_workers')\n"
        "sys.modules['only_on_workers'] = mod\n"
        "exec('class C:\\n    pass', mod.__dict__)\n"
        "mod.C.__module__ = 'only_on_workers'\n"
        "mod.C()"
    )
    return ctx.mesh.exec(src).fetch(timeout=30)


def _fd_output(ctx):
    ctx.mesh.exec("import os\nos.write(1, b'\\xff\\xfe raw fd bytes\\n')").fetch(timeout=30)
    proc = ctx.ctrl.workers.procs[0]
    return wait_for(
        lambda: "\ufffd\ufffd raw fd bytes" in proc.tail_text(), 10, "the fd bytes in the tail"
    )


CASES = [
    # ---------------------------------------------------------------- values and arguments
    Bad(
        "unpicklable-argument",
        lambda c: mnb.remote(add)(threading.Lock(), 1, mesh=c.mesh),
        TypeError,
        r"^cannot send the arguments: cannot send \(\(<unlocked _thread.lock object at 0x\w+>, 1\), "
        r"\{\}\): TypeError: cannot pickle '_thread.lock' object$",
    ),
    Bad(
        "unpicklable-push",
        lambda c: c.mesh.push(lock=threading.Lock()),
        TypeError,
        r"^cannot send the arguments: .*cannot pickle '_thread.lock' object$",
    ),
    Bad(
        "argument-with-failing-reduce",
        lambda c: mnb.remote(add)(BadReduce(), 1, mesh=c.mesh),
        TypeError,
        r"^cannot send the arguments: .*ValueError: no pickling today$",
    ),
    Bad(
        "argument-too-deep-to-pickle",
        lambda c: mnb.remote(len)(deep_list(), mesh=c.mesh),
        TypeError,
        r"^cannot send the arguments: cannot send <tuple object>: RecursionError: maximum "
        r"recursion depth exceeded",
    ),
    Bad(
        "argument-unloadable-on-workers",
        lambda c: mnb.remote(lambda a: a)(ImportsNothing(), mesh=c.mesh).fetch(timeout=30),
        mnb.RemoteError,
        r"ModuleNotFoundError: No module named 'no_such_module_anywhere'",
        check=failed_with("ModuleNotFoundError", r"^No module named 'no_such_module_anywhere'$"),
        remote=ModuleNotFoundError,
    ),
    Bad(
        "unpicklable-result",
        lambda c: c.ref(lock_value).fetch(timeout=30),
        mnb.RemoteError,
        r"cannot send the value back: cannot send <unlocked _thread.lock object at 0x\w+>: "
        r"TypeError: cannot pickle '_thread.lock' object",
        check=failed_with("TypeError", r"^cannot send the value back"),
    ),
    Bad(
        "generator-result",
        lambda c: c.mesh.exec("(i for i in range(3))").fetch(timeout=30),
        mnb.RemoteError,
        r"cannot send the value back: .*cannot pickle 'generator' object",
        check=failed_with("TypeError"),
    ),
    Bad(
        "result-with-failing-reduce",
        lambda c: c.ref(bad_reduce_value).fetch(timeout=30),
        mnb.RemoteError,
        r"cannot send the value back: cannot send <.*BadReduce object at 0x\w+>: ValueError: "
        r"no pickling today",
        check=failed_with("TypeError"),
    ),
    Bad(
        "result-too-deep-to-pickle",
        lambda c: c.ref(deep_list).fetch(timeout=30),
        mnb.RemoteError,
        r"cannot send the value back: cannot send <list object>: RecursionError: maximum "
        r"recursion depth exceeded",
        check=failed_with("TypeError"),
    ),
    Bad(
        "result-unloadable-on-controller",
        _unloadable_on_controller,
        mnb.RemoteError,
        r"the value arrived but cannot be unpickled here: No module named 'only_on_workers'",
        check=failed_with("ModuleNotFoundError"),
    ),
    Bad(
        "big-argument-256mb",
        _big_argument(256 << 20),
        None,
        check=lambda res, c: res == [(64 << 20, 1.0)] * 2,
    ),
    Bad(
        "big-in-band-argument-64mb",
        lambda c: mnb.remote(len)(b"\x01" * (64 << 20), mesh=c.mesh).fetch(timeout=120),
        None,
        check=lambda res, c: res == [64 << 20] * 2,
    ),
    # ---------------------------------------------------------------- dims, ranks, meshes
    Bad(
        "zero-sized-dim",
        lambda c: mnb.local_mesh(dp=0),
        ValueError,
        r"^dim 'dp' must be a positive int, got 0$",
    ),
    Bad(
        "string-sized-dim",
        lambda c: mnb.local_mesh(dp="2"),
        ValueError,
        r"^dim 'dp' must be a positive int, got '2'$",
    ),
    Bad(
        "no-dims",
        lambda c: mnb.local_mesh(),
        ValueError,
        r"^local_mesh\(\) needs at least one named dim, e.g. local_mesh\(dp=2\)$",
    ),
    Bad(
        "unknown-backend",
        lambda c: mnb.local_mesh(dp=1, backend="mpx"),
        ValueError,
        r"^unknown backend 'mpx': expected 'gloo' or 'nccl'$",
    ),
    Bad(
        "two-meshes-with-one-name",
        lambda c: mnb.local_mesh(dp=1, name=MESH),
        ValueError,
        rf"^a mesh named '{MESH}' already exists: shut it down first or pick another name$",
    ),
    Bad(
        "slice-unknown-dim",
        lambda c: c.mesh.slice(tp=0),
        ValueError,
        rf"^mesh '{MESH}' has no dim 'tp' \(dims: \['dp'\]\)$",
    ),
    Bad(
        "slice-index-out-of-range",
        lambda c: c.mesh.slice(dp=2),
        IndexError,
        r"^index 2 out of range for dim 'dp' of size 2$",
    ),
    Bad(
        "slice-empty",
        lambda c: c.mesh.slice(dp=slice(2, 5)),
        IndexError,
        r"^slice slice\(2, 5, None\) of dim 'dp' \(size 2\) is empty$",
    ),
    Bad(
        "slice-wrong-type",
        lambda c: c.mesh.slice(dp="0"),
        TypeError,
        r"^dim 'dp': expected an int or a slice, got str$",
    ),
    Bad(
        "rename-not-identifier",
        lambda c: c.mesh.rename(dp="1x"),
        ValueError,
        r"^new dim name '1x' is not an identifier$",
    ),
    Bad(
        "reduce-unknown-dim",
        lambda c: c.ref().reduce("tp"),
        ValueError,
        rf"^unknown dim 'tp': mesh '{MESH}' has dims \['dp'\]$",
    ),
    Bad(
        "reduce-unknown-reduction",
        lambda c: c.ref().reduce("dp", "mean"),
        ValueError,
        r"^unknown reduction 'mean': expected one of sum, avg, max, min, product, stack$",
    ),
    Bad(
        "reduce-stack-in-place",
        lambda c: c.ref().reduce("dp", "stack", inplace=True),
        ValueError,
        r"^reduction 'stack' with scatter=False cannot be in place: the result has a new shape \(only all_reduce and stack with scatter=True keep it\)$",
    ),
    Bad(
        "reduce-of-a-non-tensor",
        lambda c: c.mesh.exec("rank").reduce("dp").fetch(timeout=60),
        mnb.RemoteError,
        r"not a tensor",
        remote=ValueError,
    ),
    Bad(
        "reduce-of-mismatched-shapes",
        lambda c: c.ref(shaped, 3).reduce("dp").fetch(timeout=60),
        mnb.RemoteError,
        r"shape",
        remote=ValueError,
    ),
    Bad(
        "process-group-unknown-dim",
        lambda c: c.mesh.process_group("tp"),
        ValueError,
        rf"^unknown dim 'tp': mesh '{MESH}' has dims \['dp'\]$",
    ),
    Bad(
        "fetch-unknown-rank",
        lambda c: c.ref().fetch(rank=7),
        ValueError,
        rf"^rank 7 is not in mesh '{MESH}' \(ranks \[0, 1\]\)$",
    ),
    Bad(
        "fetch-negative-rank",
        lambda c: c.ref().fetch(rank=-1),
        ValueError,
        rf"^rank -1 is not in mesh '{MESH}' \(ranks \[0, 1\]\)$",
    ),
    Bad(
        "fetch-rank-as-string",
        lambda c: c.ref().fetch(rank="0"),
        ValueError,
        rf"^rank '0' is not in mesh '{MESH}' \(ranks \[0, 1\]\)$",
    ),
    Bad(
        "fetch-rank-outside-a-sub-mesh",
        lambda c: mnb.remote(rank_value)(mesh=c.mesh.slice(dp=0)).fetch(rank=1),
        ValueError,
        rf"^rank 1 is not in mesh '{MESH}' \(ranks \[0\]\)$",
    ),
    Bad(
        "pull-unknown-rank",
        lambda c: c.mesh.pull("rank", rank=5),
        ValueError,
        rf"^rank 5 is not in mesh '{MESH}' \(ranks \[0, 1\]\)$",
    ),
    Bad(
        "sub-mesh-ref-used-on-the-whole-mesh",
        lambda c: mnb.remote(add)(mnb.remote(rank_value)(mesh=c.mesh.slice(dp=1)), 1, mesh=c.mesh),
        mnb.RefUseError,
        r"^Ref \d+ has values on ranks \[1\] only; the call runs on \[0, 1\]$",
    ),
    # ---------------------------------------------------------------- refs
    Bad(
        "fetch-deleted-ref",
        lambda c: c.deleted().fetch(),
        mnb.RefUseError,
        r"^Ref \d+ was deleted$",
    ),
    Bad(
        "deleted-ref-as-argument",
        lambda c: mnb.remote(add)(c.deleted(), 1, mesh=c.mesh),
        mnb.RefUseError,
        r"^Ref \d+ was deleted$",
    ),
    Bad(
        "reduce-deleted-ref",
        lambda c: c.deleted().reduce("dp"),
        mnb.RefUseError,
        r"^Ref \d+ was deleted$",
    ),
    Bad(
        "borrow-deleted-ref",
        lambda c: c.deleted().borrow(c.mesh.stream("rel-side")),
        mnb.RefUseError,
        r"^Ref \d+ was deleted$",
    ),
    Bad(
        "push-deleted-ref",
        lambda c: c.mesh.push(x=c.deleted()),
        mnb.RefUseError,
        r"^Ref \d+ was deleted$",
    ),
    Bad(
        "ref-of-another-stream",
        lambda c: mnb.remote(add)(c.ref(), 1, mesh=c.mesh, stream=c.mesh.stream("rel-side")),
        mnb.RefUseError,
        r"^Ref \d+ was produced on stream 'default'; to use it on stream 'rel-side', borrow it: "
        r"ref.borrow\(stream\)$",
    ),
    Bad(
        "borrow-onto-its-own-stream",
        lambda c: c.ref().borrow(c.mesh.default_stream),
        ValueError,
        r"^Ref \d+ is already on stream 'default'$",
    ),
    Bad(
        "ref-of-another-mesh",
        lambda c: mnb.remote(add)(mnb.remote(rank_value)(mesh=c.other), 1, mesh=c.mesh),
        mnb.RefUseError,
        rf"^Ref \d+ lives on mesh '{OTHER}', not on mesh '{MESH}': copy it with ref.to_mesh\(...\)$",
    ),
    Bad(
        "to-mesh-of-another-world",
        lambda c: mnb.remote(rank_value)(mesh=c.other).to_mesh(c.mesh),
        mnb.RefUseError,
        rf"^Ref \d+ lives on mesh '{OTHER}'; mesh '{MESH}' is another world: fetch and send "
        r"the value instead$",
    ),
    Bad(
        "to-mesh-of-another-size",
        lambda c: c.ref().to_mesh(c.mesh.slice(dp=0)),
        ValueError,
        r"^to_mesh\(\) needs meshes of one size: 2 ranks -> 1 ranks$",
    ),
    Bad(
        "ref-from-before-a-restart",
        lambda c: c.stale.fetch(),
        mnb.RefUseError,
        rf"^Ref \d+ belongs to generation 0 of mesh '{OTHER}', which was restarted \(now "
        r"generation 1\)$",
    ),
    # ---------------------------------------------------------------- API misuse
    Bad(
        "remote-of-a-non-callable",
        lambda c: mnb.remote(42),
        TypeError,
        r"^remote\(\) needs a callable, got int$",
    ),
    Bad(
        "mesh-keyword-not-a-mesh",
        lambda c: mnb.remote(add)(1, 2, mesh="rel"),
        TypeError,
        r"^mesh= must be a DeviceMesh, got str$",
    ),
    Bad(
        "stream-keyword-not-a-stream",
        lambda c: mnb.remote(add)(1, 2, mesh=c.mesh, stream="side"),
        TypeError,
        r"^stream= must be a Stream \(mesh.stream\(name\)\), got str$",
    ),
    Bad(
        "empty-stream-name",
        lambda c: c.mesh.stream(""),
        ValueError,
        r"^a stream name must be a non-empty string$",
    ),
    Bad(
        "exec-of-bytes",
        lambda c: c.mesh.exec(b"1 + 1"),
        TypeError,
        r"^exec\(\) needs source text, got bytes$",
    ),
    Bad(
        "exec-syntax-error",
        lambda c: c.mesh.exec("def (:\n  pass"),
        SyntaxError,
        r"^invalid syntax \(<exec>, line 1\)$",
    ),
    Bad(
        "pull-not-a-name",
        lambda c: c.mesh.pull("1a"),
        ValueError,
        r"^pull\(\) needs a variable name, got '1a'$",
    ),
    Bad(
        "pull-undefined-name",
        lambda c: c.mesh.pull("never_defined_here", timeout=30),
        mnb.RemoteError,
        r"NameError: name 'never_defined_here' is not defined on rank 0",
        check=failed_with("NameError"),
        remote=NameError,
    ),
    Bad(
        "wrong-argument-count",
        lambda c: mnb.remote(add)(1, mesh=c.mesh).fetch(timeout=30),
        mnb.RemoteError,
        r"TypeError: add\(\) missing 1 required positional argument: 'b'",
        check=failed_with("TypeError", r"^add\(\) missing 1 required positional argument: 'b'$"),
        remote=TypeError,
    ),
    Bad(
        "fetch-with-a-misspelt-keyword",
        lambda c: c.ref().fetch(rnk=0),
        TypeError,
        r"unexpected keyword argument 'rnk'",
    ),
    Bad(
        "fetch-timeout",
        lambda c: mnb.remote(time.sleep)(1.0, mesh=c.mesh).fetch(timeout=0.05),
        TimeoutError,
        r"fetch of Ref \d+ did not finish within 0.05 s .*it was cancelled",
        after=lambda c: c.mesh.wait(timeout=30),
    ),
    Bad(
        "fetch-timeout-zero",
        lambda c: mnb.remote(add)(1, 2, mesh=c.mesh).fetch(timeout=0),
        ValueError,
        r"^timeout must be > 0 seconds \(or None: no limit\), got 0$",
    ),
    Bad(
        "fetch-timeout-negative",
        lambda c: mnb.remote(add)(1, 2, mesh=c.mesh).fetch_async(timeout=-1),
        ValueError,
        r"^timeout must be > 0 seconds \(or None: no limit\), got -1$",
    ),
    Bad(
        "cancel-twice",
        lambda c: _cancel_twice(c.mesh),
        None,
        "",
        check=lambda r, c: r == (True, False, True),
        after=lambda c: _interrupt_quietly(c.mesh),
    ),
    Bad(
        "pipe-without-room",
        lambda c: c.mesh.pipe(print, max_messages=0),
        ValueError,
        r"^max_messages must be a positive int, got 0$",
    ),
    Bad(
        "pipe-with-a-ref-argument",
        lambda c: c.mesh.pipe(print, c.ref()),
        mnb.RefUseError,
        r"^a pipe's arguments are sent to another process: pass values, not Refs$",
    ),
    # ---------------------------------------------------------------- user code on the workers
    Bad(
        "recursion-error",
        lambda c: c.ref(recurse).fetch(timeout=30),
        mnb.RemoteError,
        r"RecursionError: maximum recursion depth exceeded",
        check=failed_with("RecursionError", r"^maximum recursion depth exceeded"),
        remote=RecursionError,
    ),
    Bad(
        "system-exit",
        lambda c: c.mesh.exec("import sys\nsys.exit(3)").fetch(timeout=30),
        mnb.RemoteError,
        r"SystemExit: 3",
        check=failed_with("SystemExit", r"^3$"),
    ),
    Bad(
        "exit-builtin",
        lambda c: c.mesh.exec("exit()").fetch(timeout=30),
        mnb.RemoteError,
        r"SystemExit",
        check=failed_with("SystemExit"),
    ),
    Bad(
        "keyboard-interrupt-raised-by-user-code",
        lambda c: c.mesh.exec("raise KeyboardInterrupt('mine')").fetch(timeout=30),
        mnb.RemoteError,
        r"KeyboardInterrupt: mine",
        check=failed_with("KeyboardInterrupt", r"^mine$"),
    ),
    Bad(
        "input-on-a-worker",
        lambda c: c.mesh.exec("input('? ')").fetch(timeout=30),
        mnb.RemoteError,
        r"EOFError: a worker has no stdin: input\(\) cannot read there",
        check=failed_with("EOFError", r"^a worker has no stdin"),
        remote=EOFError,
    ),
    Bad(
        "exception-with-a-broken-str",
        lambda c: c.ref(raise_with_broken_str).fetch(timeout=30),
        mnb.RemoteError,
        r"Broken",
        check=failed_with("Broken", r"^<unprintable exception>$"),
    ),
    Bad(
        "exception-type-not-importable-on-the-controller",
        _type_only_on_workers,
        mnb.RemoteError,
        r"\(raised here as a plain mnb.RemoteError, not as Gone: module "
        r"'errors_only_on_workers' is not imported here\)\n",
        check=failed_with("Gone", r"^from a module the controller lacks$"),
    ),
    Bad(
        "exception-whose-init-needs-arguments",
        lambda c: c.ref(raise_needs_args).fetch(timeout=30),
        mnb.RemoteError,
        rf"(?s)^raise_needs_args failed on ranks 0-1 of mesh '{MESH}'\n.*"
        r"NeedsArgs: data.csv:7: bad record$",
        check=failed_with("NeedsArgs", r"^data.csv:7: bad record$"),
        remote=NeedsArgs,
    ),
    Bad(
        "exception-with-its-own-new",
        lambda c: c.ref(raise_own_new).fetch(timeout=30),
        mnb.RemoteError,
        r"\(raised here as a plain mnb.RemoteError, not as OwnNew: OwnNew defines __new__\)",
        check=failed_with("OwnNew", r"^5$"),
    ),
    Bad(
        "os-exit-in-user-code",
        _os_exit,
        mnb.WorkerCrashed,
        rf"^worker rank 1 of mesh '{MESH}' died \(exit code 0\)",
        check=lambda e, c: e.rank == 1 and e.exit_code == 0,
        after=_restart,
    ),
    Bad(
        "non-utf8-bytes-via-sys-stdout-buffer",
        output_check({0: "\ufffd\ufffd bytes out\n", 1: "\ufffd\ufffd bytes out\n"})(
            lambda c: c.mesh.exec(
                "import sys\nsys.stdout.buffer.write(b'\\xff\\xfe bytes out\\n')"
            ).fetch(timeout=30)
        ),
        None,
        check=lambda res, c: res[0] == [13, 13],  # bytes written
    ),
    Bad(
        "lone-surrogates-in-printed-text",
        output_check({0: "a\ufffdb \U0001f600\n", 1: "a\ufffdb \U0001f600\n"})(
            lambda c: c.mesh.exec("print('a\\udcffb \\ud83d\\ude00')").fetch(timeout=30)
        ),
        None,
        check=lambda res, c: all(
            t.encode("utf-8") for t in res[1].text.get(0, [])
        ),  # every piece encodes: no surrogate reached the controller
    ),
    Bad(
        "non-utf8-bytes-to-fd-1",
        _fd_output,
        None,
    ),
    Bad(
        "print-after-closing-sys-stdout",
        output_check({0: "still here\n", 1: "still here\n"})(
            lambda c: c.mesh.exec("import sys\nsys.stdout.close()\nprint('still here')").fetch(
                timeout=30
            )
        ),
        None,
    ),
    Bad(
        "print-of-1gb",
        _big_print(1 << 30),
        None,
        check=_check_big_print(1 << 30),
    ),
    Bad(
        "breakpoint-inside-a-collective",
        _breakpoint_in_collective,
        None,
        check=lambda res, c: [t.tolist() for t in res] == [[3.0, 3.0], [3.0, 3.0]],
    ),
    # ---------------------------------------------------------------- magics
    Bad(
        "magic-dim-size-not-a-number",
        lambda c: c.line("dp=x --name rel-magic"),
        UsageError,
        r"^%monarch_mesh: the size of dim 'dp' must be a positive integer, got 'x'$",
    ),
    Bad(
        "magic-dim-without-size",
        lambda c: c.line("dp --name rel-magic"),
        UsageError,
        r"^%monarch_mesh: unexpected argument 'dp': dims are written NAME=SIZE, e.g. dp=2$",
    ),
    Bad(
        "magic-reserved-word-as-dim",
        lambda c: c.line("name=2"),
        UsageError,
        r"^%monarch_mesh: 'name' \(in 'name=2'\) is not a dim name: use --name instead$",
    ),
    Bad(
        "magic-restart-with-dims",
        lambda c: c.line(f"--restart dp=2 --name {MESH}"),
        UsageError,
        r"^%monarch_mesh: --restart takes no dims or --backend \(got 'dp=2'\); name the mesh "
        r"with --name$",
    ),
    Bad(
        "magic-shutdown-unknown-mesh",
        lambda c: c.line("--shutdown --name no-such-mesh"),
        UsageError,
        r"^%monarch_mesh --shutdown: no mesh named 'no-such-mesh' \(meshes: .*\)$",
    ),
    Bad(
        "magic-unknown-option",
        lambda c: c.line("dp=2 --bogus"),
        UsageError,
        r"^%monarch_mesh: unrecognized arguments: --bogus\nusage: ",
    ),
    Bad(
        "magic-unbalanced-quote",
        lambda c: c.line('dp=2 --name "oops'),
        UsageError,
        r"^%monarch_mesh: cannot split the arguments: No closing quotation$",
    ),
    Bad(
        "magic-world-without-connect",
        lambda c: c.line("dp=2 --world 2 --name rel-magic"),
        UsageError,
        r"^%monarch_mesh: --world and --connection-file go with --connect$",
    ),
    Bad(
        "cell-unknown-mesh",
        lambda c: c.cell("--mesh no-such-mesh", "1"),
        UsageError,
        r"^%%monarch --mesh: no mesh named 'no-such-mesh' \(meshes: .*\)$",
    ),
    Bad(
        "cell-unknown-rank",
        lambda c: c.cell(f"--mesh {MESH} --ranks 0,9", "1"),
        UsageError,
        rf"^%%monarch: --ranks '0,9': rank 9 is not in mesh '{MESH}' \(ranks \[0, 1\]\)$",
    ),
    Bad(
        "cell-rank-not-a-number",
        lambda c: c.cell(f"--mesh {MESH} --ranks x", "1"),
        UsageError,
        r"^%%monarch: --ranks 'x': 'x' is not a rank or a range like 0-3$",
    ),
    Bad(
        "cell-slice-out-of-range",
        lambda c: c.cell(f"--mesh {MESH} --slice dp=5", "1"),
        UsageError,
        r"^%%monarch: --slice 'dp=5': index 5 out of range for dim 'dp' of size 2$",
    ),
    Bad(
        "cell-ranks-and-slice",
        lambda c: c.cell(f"--mesh {MESH} --ranks 0 --slice dp=0", "1"),
        UsageError,
        r"argument --slice: not allowed with argument --ranks",
    ),
    Bad(
        "cell-empty-stream-name",
        lambda c: c.cell(f'--mesh {MESH} --stream ""', "1"),
        UsageError,
        r"^%%monarch: --stream needs a name$",
    ),
    Bad(
        "cell-push-not-a-name",
        lambda c: c.cell(f"--mesh {MESH} --push 1x", "1"),
        UsageError,
        r"^%%monarch: --push '1x': '1x' is not a variable name$",
    ),
    Bad(
        "cell-syntax-error",
        lambda c: c.cell(f"--mesh {MESH}", "x = (1,\ny = 2"),
        CellSyntaxError,
        r"^'\(' was never closed \(<monarch In\[\d+\](#\d+)?>, line 2\)$",
    ),
    Bad(
        "cell-raising",
        lambda c: c.cell(f"--mesh {MESH}", "1 / (rank - rank)"),
        RemoteCellError,
        rf"^%%monarch In\[\d+\](#\d+)? on mesh '{MESH}' failed on ranks 0-1\n",
        check=failed_with("ZeroDivisionError", r"^division by zero$"),
    ),
    Bad(
        "cell-printing-non-utf8",
        lambda c: c.cell(f"--mesh {MESH}", "import sys\nsys.stdout.buffer.write(b'\\xc3\\x28')"),
        None,
    ),
    # last: it shuts the other mesh down
    Bad(
        "fetch-during-shutdown",
        _fetch_during_shutdown,
        mnb.MeshClosedError,
        rf"^mesh '{OTHER}' is shut down$",
        after=_after_shutdown,
    ),
]


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    os.environ.setdefault("IPYTHONDIR", str(tmp_path_factory.mktemp("ipython")))
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    mesh = mnb.local_mesh(dp=2, name=MESH)
    other = mnb.local_mesh(dp=1, name=OTHER)
    stale = mnb.remote(rank_value)(mesh=other)
    other.restart()
    config = Config()
    config.HistoryManager.enabled = False
    shell = InteractiveShell.instance(config=config)
    shell.extension_manager.load_extension("monarch_nb")
    c = Ctx(mesh, other, stale, shell)
    try:
        yield c
    finally:
        shell.extension_manager.unload_extension("monarch_nb")
        InteractiveShell.clear_instance()
        other.shutdown()
        mesh.shutdown()


def computes(mesh) -> None:
    """The mesh runs commands, values and collectives correctly, and no failure
    is left unreported."""
    mesh.wait(timeout=60)
    assert mnb.remote(add)(1, 2, mesh=mesh).fetch(timeout=60) == [3, 3]
    total = mnb.remote(rank_value)(mesh=mesh).reduce("dp").fetch(timeout=60)
    assert [t.tolist() for t in total] == [[3.0, 3.0], [3.0, 3.0]]


def test_catalogue_is_large_and_unique():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))
    assert len(ids) >= 40


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Bad, ctx):
    run(case, ctx)


def run(case: Bad, ctx) -> None:
    try:
        if case.raises is None:
            result = case.action(ctx)
            if case.check is not None:
                assert case.check(result, ctx) is not False, f"{case.id}: unexpected {result!r}"
            return
        with pytest.raises(BaseException) as ei:
            case.action(ctx)
        err = ei.value
        if case.remote is None:
            assert type(err) is case.raises, f"{case.id}: {type(err).__name__}: {err}"
        else:  # exactly a RemoteError that is also the remote type
            assert type(err).__bases__ == (case.raises, case.remote), f"{case.id}: {err!r}"
        assert re.search(case.match, str(err)), f"{case.id}: {str(err)!r} !~ {case.match!r}"
        if case.check is not None:
            assert case.check(err, ctx) is not False, f"{case.id}: check failed on {err!r}"
    finally:
        ctx.mesh.debugger.continue_all()  # nothing may stay paused
        if case.after is not None:
            case.after(ctx)
        computes(ctx.mesh)


def test_the_same_mesh_still_computes_after_the_catalogue(ctx):
    computes(ctx.mesh)
    ctx.mesh.exec("import torch\nw = torch.arange(4.0) * (rank + 1)")
    assert [t.tolist() for t in ctx.mesh.pull("w", timeout=30)] == [
        [0.0, 1.0, 2.0, 3.0],
        [0.0, 2.0, 4.0, 6.0],
    ]
    st = ctx.mesh.status()
    assert all(r["alive"] for r in st["ranks"].values())
    assert st["internal_errors"] == [] and st["bad_messages"] == 0


# ---------------------------------------------------------------- full sizes (slow)


@pytest.mark.slow
def test_two_gb_argument(ctx):
    run(Bad("argument-2gb", _big_argument(2 << 30), None), ctx)
