"""Kernel tier: remote errors as a notebook shows them (a real IPython kernel through
jupyter_client, real workers): the remote type, the user's own frames under their
``Cell In[n]`` names, no internal frames; a crashed worker said once per cell."""

from __future__ import annotations

import pytest
from kernel_helpers import errors, errors_text, mesh_kernel, stream

pytestmark = pytest.mark.kernel


@pytest.fixture(scope="module")
def k(tmp_path_factory):
    with mesh_kernel(tmp_path_factory.mktemp("errors")) as kern:
        yield kern


def count(reply) -> int:
    return reply["content"]["execution_count"]


def no_internals(tb: str) -> None:
    for internal in ("concurrent/futures", "_base.py", "monarch_nb/", "ipykernel_", "command "):
        assert internal not in tb, (internal, tb)


def test_a_fetch_error_renders_like_a_local_traceback(k):
    define, _ = k.run("def bad(v):\n    raise ValueError(f'bad value {v}')\n")
    reply, msgs = k.run("r = mnb.remote(bad)(3)\nr.fetch()")
    assert reply["content"]["status"] == "error"
    (e,) = errors(msgs)
    assert e["ename"] == "RemoteError(ValueError)"
    lines = errors_text(msgs).split("\n")
    assert lines[0] == "RemoteError(ValueError): bad failed on ranks 0-1 of mesh 'default'"
    tb = "\n".join(lines)
    # the user's line that fetched, then the remote frames with the cell's real lines
    assert f"  Cell In[{count(reply)}], line 2, in <module>\n    r.fetch()\n--- ranks 0-1 ---" in tb
    assert f"  Cell In[{count(define)}], line 2, in bad\n" in tb
    assert "raise ValueError(f'bad value {v}')" in tb and tb.endswith("ValueError: bad value 3")
    no_internals(tb)
    # and the remote type is caught by its own name
    msgs = k.ok(
        "try:\n    r.fetch()\nexcept ValueError as e:\n    print('caught', e.failures[0][1])"
    )
    assert stream(msgs) == "caught bad value 3\n"
    # an exception class of the notebook itself, with an __init__ that needs arguments
    k.ok(
        "class BadBatch(Exception):\n    def __init__(self, i, why):\n"
        "        super().__init__(f'batch {i}: {why}')\n"
        "def load(i):\n    raise BadBatch(i, 'empty')\n"
    )
    msgs = k.ok(
        "try:\n    mnb.remote(load)(7).fetch()\nexcept BadBatch as e:\n"
        "    print(type(e).__name__, isinstance(e, mnb.RemoteError), e.failures[1][1])"
    )
    assert stream(msgs) == "RemoteError(BadBatch) True batch 7: empty\n"


def test_a_crash_is_announced_once_per_cell_with_the_way_out(k):
    reply, msgs = k.run(
        "%%monarch\nimport os\nif rank == 1:\n    os.kill(os.getpid(), 9)\n", timeout=60
    )
    assert reply["content"]["status"] == "error"
    everything = stream(msgs, "stdout") + stream(msgs, "stderr") + errors_text(msgs)
    assert everything.count("died") == 1, everything
    (line,) = errors_text(msgs).split("\n")
    assert line == (
        f"%%monarch In[{count(reply)}] on mesh 'default': worker rank 1 died (killed by signal "
        "SIGKILL); %monarch_mesh --restart (or mesh.restart()) gives fresh workers"
    )
    # the next cell and the next call: the mesh needs a restart, no old traceback
    reply, msgs = k.run("%%monarch\n1 + 1")
    assert errors_text(msgs) == (
        "mesh 'default' needs a restart: its worker rank 1 died earlier (killed by signal "
        "SIGKILL); %monarch_mesh --restart (or mesh.restart()) gives fresh workers"
    )
    reply, msgs = k.run("mnb.remote(bad)(1).fetch()")
    (e,) = errors(msgs)
    assert e["ename"] == "WorkerCrashed"
    assert errors_text(msgs) == (
        "WorkerCrashed: mesh 'default' needs a restart: its worker rank 1 died earlier (killed "
        "by signal SIGKILL); mesh.restart() (%monarch_mesh --restart) gives fresh workers\n"
        f"  Cell In[{count(reply)}], line 1, in <module>\n    mnb.remote(bad)(1).fetch()"
    )
    k.ok("%monarch_mesh --restart", timeout=120)
    assert k.value("mnb.remote(lambda: 7)().fetch()") == [7, 7]
