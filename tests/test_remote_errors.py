"""Workers tier: a remote exception keeps its type (``except ValueError:`` around a
fetch catches it), survives pickling, renders like a local traceback, and a crashed
worker is said once, then each later call says the mesh needs a restart."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import time
import traceback

import pytest
from wait_helpers import wait_for
from worker_probes import rank_pids

import monarch_nb as mnb


class NeedsArgs(Exception):
    """Its __init__ needs two arguments; the controller never calls it."""

    def __init__(self, path, line):
        super().__init__(f"{path}:{line}: bad record")
        self.path = path


def raise_value_error(v):
    raise ValueError(f"bad value {v}")


def raise_needs_args():
    raise NeedsArgs("data.csv", 7)


def raise_per_rank():
    if mnb.current_rank() == 0:
        raise KeyError("k0")
    raise ValueError("v1")


def open_missing():
    with open("/nonexistent/monarch-nb-test"):
        pass


def raise_from_worker_only_module():
    import sys
    import types

    mod = types.ModuleType("errors_only_here")
    sys.modules["errors_only_here"] = mod
    exec("class Gone(Exception):\n    pass", mod.__dict__)
    mod.Gone.__module__ = "errors_only_here"
    raise mod.Gone("from the worker")


def add(a, b):
    return a + b


def serves(mesh) -> None:
    assert mnb.remote(add)(1, 2, mesh=mesh).fetch(timeout=30) == [3, 3]


def test_except_value_error_catches_a_remote_value_error(mesh):
    r = mnb.remote(raise_value_error)(3, mesh=mesh)
    try:
        r.fetch(timeout=30)
    except ValueError as caught:
        e = caught
    else:
        pytest.fail("no error")
    assert isinstance(e, mnb.RemoteError) and e.remote_type is ValueError
    assert type(e).__name__ == "RemoteError(ValueError)"
    # the attributes of a RemoteError keep working
    assert sorted(e.failures) == [0, 1] and e.failures[0][:2] == ("ValueError", "bad value 3")
    assert "raise ValueError" in e.failures[0][2]
    assert e.origins[1] == ("builtins", "ValueError")
    assert e.ident == r.ident and e.context.startswith("raise_value_error failed on ranks 0-1")
    assert "command" not in str(e).splitlines()[0]
    # the same error raised by the values that depend on it, and by mesh.wait()
    dep = mnb.remote(add)(r, 1, mesh=mesh)
    with pytest.raises(ValueError, match="bad value 3") as ei:
        dep.fetch(timeout=30)
    assert isinstance(ei.value, mnb.RemoteError)
    mnb.remote(raise_value_error)(4, mesh=mesh)
    with pytest.raises(ValueError, match="bad value 4"):
        mesh.wait(timeout=30)
    serves(mesh)


def test_typed_errors_pickle_with_their_type_and_attributes(mesh):
    with pytest.raises(mnb.RemoteError) as ei:
        mnb.remote(raise_value_error)(5, mesh=mesh).fetch(timeout=30)
    e = ei.value
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is type(e) and isinstance(back, ValueError)
    assert (back.failures, back.ident, back.context, back.origins) == (
        e.failures,
        e.ident,
        e.context,
        e.origins,
    )
    assert str(back) == str(e)
    crashed = mnb.WorkerCrashed(1, -9, "last words", "m")
    again = pickle.loads(pickle.dumps(crashed.again()))
    assert type(again) is mnb.WorkerCrashed and again.earlier and str(again) == str(crashed.again())


def test_an_exception_whose_init_needs_arguments(mesh):
    with pytest.raises(NeedsArgs) as ei:
        mnb.remote(raise_needs_args)(mesh=mesh).fetch(timeout=30)
    e = ei.value
    assert isinstance(e, mnb.RemoteError) and e.remote_type is NeedsArgs
    assert str(e).endswith("NeedsArgs: data.csv:7: bad record")
    assert not hasattr(e, "path")  # the remote object is not sent: only its type and text
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is type(e)
    serves(mesh)


def test_os_errors_keep_their_subtype(mesh):
    with pytest.raises(FileNotFoundError) as ei:
        mnb.remote(open_missing)(mesh=mesh).fetch(rank=1, timeout=30)
    assert isinstance(ei.value, OSError) and isinstance(ei.value, mnb.RemoteError)
    assert "No such file or directory" in str(ei.value)


def test_ranks_with_different_types_take_the_lowest_rank(mesh):
    with pytest.raises(mnb.RemoteError) as ei:
        mnb.remote(raise_per_rank)(mesh=mesh).fetch(timeout=30)
    e = ei.value
    assert e.remote_type is KeyError and isinstance(e, KeyError)
    assert not isinstance(e, ValueError)
    lines = str(e).splitlines()
    assert lines[1] == (
        "(ranks raised different types: this error is rank 0's KeyError; rank 1: ValueError)"
    )
    serves(mesh)


def test_types_that_cannot_be_raised_here_give_a_plain_remote_error(mesh):
    with pytest.raises(mnb.RemoteError) as ei:
        mnb.remote(raise_from_worker_only_module)(mesh=mesh).fetch(timeout=30)
    e = ei.value
    assert type(e) is mnb.RemoteError and e.remote_type is None
    assert str(e).splitlines()[1] == (
        "(raised here as a plain mnb.RemoteError, not as Gone: module 'errors_only_here' "
        "is not imported here)"
    )
    assert e.failures[0][:2] == ("Gone", "from the worker")
    # an interrupt or exit raised by user code is never raised here as one
    for src in ["raise KeyboardInterrupt('mine')", "exit(2)"]:
        with pytest.raises(mnb.RemoteError) as ei:
            mesh.exec(src).fetch(timeout=30)
        assert type(ei.value) is mnb.RemoteError
        assert not isinstance(ei.value, (KeyboardInterrupt, SystemExit))
        assert "derives from BaseException only" in str(ei.value), str(ei.value)
    serves(mesh)


def _fetch_here(r):
    return r.fetch(timeout=30)  # the user's line, kept in the rendering


def test_render_traceback_shows_the_users_frames_only(mesh):
    r = mnb.remote(raise_value_error)(6, mesh=mesh)
    with pytest.raises(ValueError) as ei:
        _fetch_here(r)
    lines = ei.value._render_traceback_()
    text = "\n".join(lines)
    assert lines[0] == (
        f"RemoteError(ValueError): raise_value_error failed on ranks 0-1 of mesh {mesh.name!r}"
    )
    here = os.path.abspath(__file__)
    assert f'File "{here}", line' in text and "in _fetch_here" in text
    assert "return r.fetch(timeout=30)" in text
    assert "--- ranks 0-1 ---" in text
    assert "in raise_value_error" in text and 'raise ValueError(f"bad value {v}")' in text
    assert text.rstrip().endswith("ValueError: bad value 6")
    assert "concurrent/futures" not in text and "monarch_nb/" not in text
    assert "command" not in text


@pytest.fixture()
def crashy():
    m = mnb.local_mesh(dp=2, name="errors-crash")
    try:
        yield m
    finally:
        m.shutdown()


def test_a_crash_is_said_once_then_each_call_says_restart(crashy, caplog):
    caplog.set_level(logging.WARNING, logger="monarch_nb.controller")
    fut = mnb.remote(time.sleep)(60, mesh=crashy).fetch_async()
    os.kill(rank_pids(crashy)[1], signal.SIGKILL)
    with pytest.raises(mnb.WorkerCrashed) as ei:
        fut.result(timeout=30)
    first = ei.value
    assert str(first).startswith(
        "worker rank 1 of mesh 'errors-crash' died (killed by signal SIGKILL); "
        "mesh.restart() (%monarch_mesh --restart) gives fresh workers"
    )
    assert str(first).count("died") == 1
    # the waiting call said it: the log does not say it again
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    depth = []
    for _ in range(3):
        with pytest.raises(mnb.WorkerCrashed) as ei:
            mnb.remote(add)(1, 2, mesh=crashy)
        e = ei.value
        assert e is not first and e.earlier and e.rank == 1
        assert str(e) == (
            "mesh 'errors-crash' needs a restart: its worker rank 1 died earlier (killed by "
            "signal SIGKILL); mesh.restart() (%monarch_mesh --restart) gives fresh workers"
        )
        assert e.__context__ is None and e.__cause__ is None
        depth.append(len(traceback.extract_tb(e.__traceback__)))
    assert depth[0] == depth[1] == depth[2]  # a new error each time, not an old one re-raised
    crashy.restart()
    serves(crashy)


def test_a_crash_with_nobody_waiting_is_logged_once(crashy, caplog):
    caplog.set_level(logging.WARNING, logger="monarch_nb.controller")
    os.kill(rank_pids(crashy)[0], signal.SIGKILL)

    def logged() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    # the mesh is broken first, then the IO thread logs it: wait for both
    wait_for(lambda: not crashy.alive and logged(), 30, "the controller to see and log the crash")
    assert logged() == [
        "worker rank 0 of mesh 'errors-crash' died (killed by signal SIGKILL); "
        "mesh.restart() (%monarch_mesh --restart) gives fresh workers"
    ]
    with pytest.raises(mnb.WorkerCrashed, match="needs a restart"):
        mnb.remote(add)(1, 2, mesh=crashy)


def test_a_ref_refuses_pickles_that_would_save_nothing_and_goes_as_an_argument(mesh):
    """pickle (torch.save) of a Ref, or a function sent by value that holds one, was a
    TypeError about a lock inside it; each now says what to do, and the Ref as an
    argument is each rank's value."""
    ones = mnb.remote(torch_ones)(3, mesh=mesh)
    with pytest.raises(pickle.PicklingError, match=r"ref\.fetch\(\)"):
        pickle.dumps(ones)
    with pytest.raises(TypeError, match="refers to a Ref.*pass the Ref as an argument"):
        mnb.remote(lambda: ones.sum().item())(mesh=mesh)
    assert mnb.remote(lambda t: t.sum().item())(ones, mesh=mesh).fetch(rank=1) == 3.0


def torch_ones(n):
    import torch

    return torch.ones(n)
